//! The wake chain's post-commit half. A terminal write NOTIFYs when its
//! snapshot shows a queued turn in the conversation; a turn whose enqueue
//! committed after that snapshot but before the terminal commit announced
//! itself while the conversation still looked busy, so nobody claimed it.
//! After the commit, this re-reads (a fresh snapshot) and knocks for it. A
//! turn enqueued later still announces itself after our commit. Batched: runs
//! that end in the same instant share one statement.

use std::sync::Arc;

use tokio::sync::mpsc;

use crate::db::{self, ConversationId};

use super::Shared;

/// Conversations waiting for the waker; run tasks wait when it is full.
pub(super) const QUEUE_MAX: usize = 1024;
/// Conversations answered by one statement.
const BATCH_MAX: usize = 256;

pub(super) async fn run(shared: Arc<Shared>, mut ended: mpsc::Receiver<ConversationId>) {
    let mut batch = Vec::with_capacity(BATCH_MAX);
    loop {
        tokio::select! {
            biased;
            n = ended.recv_many(&mut batch, BATCH_MAX) => if n == 0 { return },
            // Services stop after the last run task; answer what is queued, then go.
            _ = shared.stop_services.cancelled() => {
                ended.close();
                if ended.recv_many(&mut batch, BATCH_MAX).await == 0 {
                    return;
                }
            }
        }
        batch.sort();
        batch.dedup();
        if let Err(e) = db::runs::wake_waiting_turns(&shared.pool, &batch).await {
            // A lost hint costs the next turn one poll tick, nothing more.
            tracing::warn!(error = %e, "post-commit wake failed");
        }
        batch.clear();
    }
}
