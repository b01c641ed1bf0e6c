//! A LoRA adapter's identity, as the gateway's adapter store records it when the files are
//! uploaded and as a worker checks it before serving them ([`crate::AdapterRef::digest`]).

use sha2::{Digest, Sha256};

/// A PEFT directory's digest: SHA-256 over the length of `adapter_config.json` (8 bytes,
/// little-endian), that file, then `adapter_model.safetensors`.
pub fn peft_digest(config: &[u8], weights: &[u8]) -> String {
    let mut h = Sha256::new();
    h.update((config.len() as u64).to_le_bytes());
    h.update(config);
    h.update(weights);
    hex(&h.finalize())
}

/// A GGUF LoRA file's digest: SHA-256 of the file.
pub fn gguf_digest(file: &[u8]) -> String {
    hex(&Sha256::digest(file))
}

/// An adapter's safetensors header (its JSON index of tensors), at most: a LoRA of every
/// attention and MLP projection of a 200-layer model lists under 0.5 MiB.
pub const MAX_SAFETENSORS_HEADER: u64 = 4 << 20;
/// Tensors one adapter may list, at most (A and B of seven projections in each of 512
/// layers, with room).
pub const MAX_ADAPTER_TENSORS: usize = 8192;

/// Checks an adapter's `adapter_model.safetensors` against [`MAX_SAFETENSORS_HEADER`] and
/// [`MAX_ADAPTER_TENSORS`] before anything parses its header: the check reads the length
/// and counts the entries' `data_offsets` in place, so refusing a crafted header costs no
/// memory. The message says what is wrong, for the uploader.
pub fn check_safetensors_header(file: &[u8]) -> Result<(), String> {
    let len = file
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().unwrap_or_default()))
        .ok_or("adapter_model.safetensors is shorter than a safetensors header")?;
    if len > MAX_SAFETENSORS_HEADER {
        return Err(format!(
            "adapter_model.safetensors has a header of {len} bytes; an adapter's is at most {MAX_SAFETENSORS_HEADER}"
        ));
    }
    let header = file
        .get(8..8 + len as usize)
        .ok_or("adapter_model.safetensors: its header runs past the end of the file")?;
    let tensors = header.windows(14).filter(|w| *w == b"\"data_offsets\"").count();
    if tensors > MAX_ADAPTER_TENSORS {
        return Err(format!(
            "adapter_model.safetensors lists {tensors} tensors; an adapter has at most {MAX_ADAPTER_TENSORS}"
        ));
    }
    Ok(())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 78, finding 6: a header listing many tiny tensors, or a huge one, is refused
    /// by counting, before any parse.
    #[test]
    fn crafted_safetensors_headers_are_refused_before_parsing() {
        let file = |header: &str| {
            let mut f = (header.len() as u64).to_le_bytes().to_vec();
            f.extend_from_slice(header.as_bytes());
            f
        };
        let entry = |i: usize| format!("\"t{i}\":{{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]}}");
        let many = format!("{{{}}}", (0..9000).map(entry).collect::<Vec<_>>().join(","));
        assert!(check_safetensors_header(&file(&many))
            .unwrap_err()
            .contains("9000 tensors"));
        let few = format!("{{{}}}", (0..100).map(entry).collect::<Vec<_>>().join(","));
        check_safetensors_header(&file(&few)).unwrap();
        let mut huge = (MAX_SAFETENSORS_HEADER + 1).to_le_bytes().to_vec();
        huge.extend_from_slice(b"{}");
        assert!(check_safetensors_header(&huge).unwrap_err().contains("header of"));
        assert!(check_safetensors_header(b"{}").is_err());
        assert!(check_safetensors_header(&file("{}")[..9])
            .unwrap_err()
            .contains("past the end"));
    }

    #[test]
    fn a_peft_digest_separates_config_from_weights() {
        // Moving a byte from one file to the other changes the identity.
        assert_ne!(peft_digest(b"{}x", b"w"), peft_digest(b"{}", b"xw"));
        assert_eq!(
            gguf_digest(b""),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }
}
