//! `kimi_k2`: calls in a `<|tool_calls_section_begin|>` section.

use super::super::json_scan::skip_ws;
use super::scan::{section, section_call, up_to, Region, SectionCall};
use super::{KIMI_ARGS_BEGIN, KIMI_CALL_BEGIN, KIMI_CALL_END, KIMI_SECTION_BEGIN, KIMI_SECTION_END};

/// Kimi K2's section: `<call begin>functions.NAME:INDEX<argument begin>{…}<call end>`.
pub(super) fn kimi(text: &str) -> Region {
    let call = |text: &str, at: usize| -> SectionCall {
        let p = match up_to(text, at, KIMI_ARGS_BEGIN) {
            Ok(p) => p,
            Err(c) => return c,
        };
        let call_id = text[at..p].trim();
        let name = call_id
            .strip_prefix("functions.")
            .unwrap_or(call_id)
            .rsplit_once(':')
            .map_or(call_id, |(n, _)| n);
        let a = skip_ws(text, p + KIMI_ARGS_BEGIN.len());
        section_call(name, Some(call_id.to_string()), text, a, &[KIMI_CALL_END])
    };
    section(text, KIMI_SECTION_BEGIN, KIMI_SECTION_END, KIMI_CALL_BEGIN, &call)
}
