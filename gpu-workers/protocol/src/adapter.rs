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

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

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
