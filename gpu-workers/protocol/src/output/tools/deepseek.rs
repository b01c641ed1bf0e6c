//! `deepseek_v3` and `deepseek_v31`: calls in a `<｜tool▁calls▁begin｜>` section.

use super::super::json_scan::skip_ws;
use super::scan::{section, section_call, up_to, Region, SectionCall};
use super::{DS_CALLS_BEGIN, DS_CALLS_END, DS_CALL_BEGIN, DS_CALL_END, DS_SEP};

/// DeepSeek's sections: V3/R1 (`function<sep>name\n```json\n{…}\n```<end>`) or V3.1
/// (`name<sep>{…}<end>`).
pub(super) fn deepseek(text: &str, v3: bool) -> Region {
    let call = |text: &str, at: usize| -> SectionCall {
        let sep = match up_to(text, at, DS_SEP) {
            Ok(s) => s,
            Err(c) => return c,
        };
        if v3 {
            let name_at = sep + DS_SEP.len();
            let fence = match up_to(text, name_at, "```json") {
                Ok(f) => f,
                Err(c) => return c,
            };
            let a = skip_ws(text, fence + "```json".len());
            section_call(text[name_at..fence].trim(), None, text, a, &["```", DS_CALL_END])
        } else {
            let a = skip_ws(text, sep + DS_SEP.len());
            section_call(text[at..sep].trim(), None, text, a, &[DS_CALL_END])
        }
    };
    section(text, DS_CALLS_BEGIN, DS_CALLS_END, DS_CALL_BEGIN, &call)
}
