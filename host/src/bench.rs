//! The benchmark (`agent-host bench`).
use crate::config::{BenchArgs, DbArgs};

pub async fn run(_db: &DbArgs, _args: &BenchArgs) -> anyhow::Result<()> {
    anyhow::bail!("not yet")
}
