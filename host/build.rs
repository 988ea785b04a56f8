// `sqlx::migrate!` embeds `migrations/` at compile time; without this, a
// migration added to the directory would not rebuild the crate.
fn main() {
    println!("cargo:rerun-if-changed=../migrations");
}
