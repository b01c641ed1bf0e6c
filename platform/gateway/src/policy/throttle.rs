//! The throttle on sources presenting bad credentials (tenant keys, or the admin token in a
//! budget of its own): what [`crate::auth`] consults before it looks a credential up.

/// Invalid credentials per source address: a source may send [`AuthThrottle::BURST`] bad
/// credentials at once and [`AuthThrottle::PER_SECOND`] a second after that; past it, its
/// requests get 429 before their credential is looked at (no hashing, no database). Keys the
/// store does not know are also cached as unknown (`hearth_tenants::outage`), so even a
/// flood from many sources costs one query per distinct key id and interval.
#[derive(Default)]
pub struct AuthThrottle {
    sources: std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, (f64, std::time::Instant)>>,
}

impl AuthThrottle {
    pub const BURST: f64 = 50.0;
    pub const PER_SECOND: f64 = 10.0;
    /// Sources tracked at most (idle ones are dropped first).
    const MAX_SOURCES: usize = 100_000;

    fn refill(entry: &mut (f64, std::time::Instant)) {
        let now = std::time::Instant::now();
        entry.0 = (entry.0 + now.duration_since(entry.1).as_secs_f64() * Self::PER_SECOND).min(Self::BURST);
        entry.1 = now;
    }

    /// The source an address counts as: itself, or for IPv6 its /64 (one host's share of
    /// addresses, which a client can rotate through).
    fn source(ip: std::net::IpAddr) -> std::net::IpAddr {
        match ip {
            std::net::IpAddr::V6(v6) => {
                let bits = u128::from(v6) & !((1u128 << 64) - 1);
                std::net::IpAddr::V6(bits.into())
            }
            v4 => v4,
        }
    }

    /// Whether `ip` may present a credential now; if not, how long until it may.
    pub fn check(&self, ip: std::net::IpAddr) -> Result<(), u64> {
        let ip = Self::source(ip);
        let mut m = self.sources.lock().unwrap_or_else(|e| e.into_inner());
        let Some(e) = m.get_mut(&ip) else { return Ok(()) };
        Self::refill(e);
        if e.0 >= 1.0 {
            Ok(())
        } else {
            Err(((1.0 - e.0) / Self::PER_SECOND).ceil().max(1.0) as u64)
        }
    }

    /// `ip` presented a bad credential.
    pub fn failed(&self, ip: std::net::IpAddr) {
        let ip = Self::source(ip);
        let mut m = self.sources.lock().unwrap_or_else(|e| e.into_inner());
        if m.len() >= Self::MAX_SOURCES && !m.contains_key(&ip) {
            let horizon = std::time::Duration::from_secs_f64(Self::BURST / Self::PER_SECOND);
            m.retain(|_, (_, at)| at.elapsed() < horizon);
            if m.len() >= Self::MAX_SOURCES {
                m.clear();
            }
        }
        let e = m.entry(ip).or_insert((Self::BURST, std::time::Instant::now()));
        Self::refill(e);
        e.0 -= 1.0;
    }
}
