//! W3C Trace Context (`traceparent: 00-<trace id>-<parent span id>-<flags>`) as the gateway
//! sends it to workers, so that a worker's spans join the gateway's trace.

/// The header's name.
pub const TRACEPARENT: &str = "traceparent";

/// A span's identity as `traceparent` carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub sampled: bool,
}

impl TraceParent {
    /// The header value (version 00).
    pub fn header(&self) -> String {
        let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        format!(
            "00-{}-{}-{:02x}",
            hex(&self.trace_id),
            hex(&self.span_id),
            u8::from(self.sampled)
        )
    }

    /// Parses a header value; None for anything malformed or the all-zero ids the
    /// specification declares invalid.
    pub fn parse(v: &str) -> Option<Self> {
        let mut parts = v.trim().split('-');
        let (version, trace, span, flags) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        if version.len() != 2 || version == "ff" || (version == "00" && parts.next().is_some()) {
            return None;
        }
        let mut trace_id = [0u8; 16];
        let mut span_id = [0u8; 8];
        decode(trace, &mut trace_id)?;
        decode(span, &mut span_id)?;
        let mut f = [0u8; 1];
        decode(flags, &mut f)?;
        if trace_id == [0; 16] || span_id == [0; 8] {
            return None;
        }
        Some(Self {
            trace_id,
            span_id,
            sampled: f[0] & 1 == 1,
        })
    }
}

fn decode(hex: &str, out: &mut [u8]) -> Option<()> {
    if hex.len() != out.len() * 2 || !hex.bytes().all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()) {
        return None;
    }
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_refuses_malformed_values() {
        let t = TraceParent {
            trace_id: [0xab; 16],
            span_id: [0x01; 8],
            sampled: true,
        };
        assert_eq!(t.header(), format!("00-{}-{}-01", "ab".repeat(16), "01".repeat(8)));
        assert_eq!(TraceParent::parse(&t.header()), Some(t));
        let example = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert!(TraceParent::parse(example).is_some());
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
        ] {
            assert_eq!(TraceParent::parse(bad), None, "{bad}");
        }
    }
}
