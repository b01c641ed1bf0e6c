// The migrations are embedded by `sqlx::migrate!`; a new or changed one must rebuild this
// crate (cargo does not see files a macro reads).
fn main() {
    println!("cargo:rerun-if-changed=../migrations");
}
