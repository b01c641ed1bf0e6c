//! GCRA — the generic cell rate algorithm — the one implementation of the limits'
//! arithmetic. A subject's state is its theoretical arrival time (TAT, µs on the limiter's
//! clock); `per_minute` units spread evenly over a minute, with a burst of a whole minute's
//! worth. In-process the TATs live in a map and this code computes them; with Redis the
//! same formulas run as Lua next to the data (`limits::ADMIT_SCRIPT`/`SETTLE_SCRIPT`, one
//! round trip), held to identical decisions by a test.

/// The window a limit is expressed over, µs.
pub const WINDOW_US: u64 = 60_000_000;

/// What taking `units` would do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Take {
    /// Allowed: the new TAT and the units left in the window after it.
    Ok { tat: u64, remaining: u32 },
    /// Not now: allowed after this many µs.
    Wait(u64),
    /// Never: more units than a whole window holds.
    Never,
}

fn cost(units: u32, per_minute: u32) -> u64 {
    (u128::from(units) * u128::from(WINDOW_US) / u128::from(per_minute.max(1))) as u64
}

/// Takes `units` at `now` from a subject whose TAT is `tat` (None: never used).
pub fn take(tat: Option<u64>, now: u64, per_minute: u32, units: u32) -> Take {
    if units > per_minute {
        return Take::Never;
    }
    let start = tat.unwrap_or(now).max(now);
    let new = start.saturating_add(cost(units, per_minute));
    let ahead = new - now;
    if ahead > WINDOW_US {
        return Take::Wait(ahead - WINDOW_US);
    }
    Take::Ok {
        tat: new,
        remaining: remaining(new, now, per_minute),
    }
}

/// Units left in the window for a subject at `tat`.
pub fn remaining(tat: u64, now: u64, per_minute: u32) -> u32 {
    let ahead = tat.saturating_sub(now).min(WINDOW_US);
    (u128::from(WINDOW_US - ahead) * u128::from(per_minute) / u128::from(WINDOW_US)) as u32
}

/// Gives `units` back from a reservation taken `elapsed` µs ago: the TAT moves back by
/// their cost less what has refilled since (that part of the debt is already gone, and
/// the TAT may by now carry other requests' reservations), never before `now`.
pub fn give_back(tat: u64, now: u64, per_minute: u32, units: u32, elapsed: u64) -> u64 {
    tat.saturating_sub(cost(units, per_minute).saturating_sub(elapsed))
        .max(now)
}

/// Charges `units` whatever the limit says (usage beyond a reservation): the TAT moves on.
pub fn force(tat: Option<u64>, now: u64, per_minute: u32, units: u32) -> u64 {
    tat.unwrap_or(now).max(now).saturating_add(cost(units, per_minute))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_holds_exactly_its_units_and_refills_evenly() {
        let now = 1_000_000_000;
        // 3 per minute: three at once, the fourth in 20 s.
        let mut tat = None;
        for left in [2, 1, 0] {
            match take(tat, now, 3, 1) {
                Take::Ok { tat: t, remaining } => {
                    assert_eq!(remaining, left);
                    tat = Some(t);
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(take(tat, now, 3, 1), Take::Wait(20_000_000));
        assert!(matches!(
            take(tat, now + 20_000_000, 3, 1),
            Take::Ok { remaining: 0, .. }
        ));
        assert_eq!(take(None, now, 3, 4), Take::Never);
    }

    #[test]
    fn giving_back_restores_capacity_but_never_banks_it() {
        let now = 5_000_000_000;
        let Take::Ok { tat, remaining: left } = take(None, now, 300, 250) else {
            panic!()
        };
        assert_eq!(left, 50);
        // 240 of the 250 were not used.
        let tat = give_back(tat, now, 300, 240, 0);
        assert_eq!(remaining(tat, now, 300), 290);
        // Giving back more than was taken stops at a full window.
        assert_eq!(give_back(tat, now, 300, 1_000, 0), now);
    }

    /// A refund never reaches into later reservations: what refilled since the reservation
    /// is not given back a second time.
    #[test]
    fn a_late_refund_does_not_free_other_requests_tokens() {
        let t0 = 9_000_000_000;
        // 1000 per minute: A takes all 1000 at t0.
        let Take::Ok { tat, .. } = take(None, t0, 1000, 1000) else {
            panic!()
        };
        // 59 s later B takes 983 (what refilled).
        let t1 = t0 + 59_000_000;
        let Take::Ok { tat, .. } = take(Some(tat), t1, 1000, 983) else {
            panic!()
        };
        // A ends at 59.5 s having used nothing: its debt had all but refilled.
        let t2 = t0 + 59_500_000;
        let tat = give_back(tat, t2, 1000, 1000, t2 - t0);
        // C cannot now take another full minute's worth.
        assert!(matches!(take(Some(tat), t2, 1000, 1000), Take::Wait(_)));
    }

    #[test]
    fn forced_usage_delays_later_requests() {
        let now = 7_000_000_000;
        let tat = force(None, now, 100, 150);
        assert_eq!(remaining(tat, now, 100), 0);
        assert!(matches!(take(Some(tat), now, 100, 1), Take::Wait(_)));
    }
}
