//! The test tiers, kept honest. `.config/nextest.toml` puts every test in one tier by name:
//! `quick` needs nothing fetched, `model` needs the default model (pip) or the example
//! processors, `reference` needs llama.cpp, its reference data or the synthetic models it
//! quantizes. A helper that fetches one of these calls [`needs`] first, so a test filed in a
//! tier below what it uses fails at once instead of fetching.

/// What a test reaches for, from the cheapest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Tier {
    Model,
    Reference,
}

/// Fails the calling test if the nextest profile it runs under (`NEXTEST_PROFILE`) is a tier
/// below `tier`; any other profile, or `cargo test`, allows everything.
pub fn needs(tier: Tier) {
    let profile = std::env::var("NEXTEST_PROFILE").unwrap_or_default();
    let allowed = match profile.as_str() {
        "quick" => None,
        "model" => Some(Tier::Model),
        _ => Some(Tier::Reference),
    };
    assert!(
        allowed.is_some_and(|a| tier <= a),
        "this test needs the {tier:?} tier but is filed in nextest's `{profile}` profile: move it in .config/nextest.toml"
    );
}
