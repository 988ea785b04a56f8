//! The wake chain's second half, after a run's terminal write has committed:
//! a knock for a turn the terminal write could not see (see
//! `db::lifecycle::announce_ended`: a read, and a NOTIFY only when a turn is
//! queued). Batched: runs that end in the same instant share one read. The
//! run's tails were told by its terminal write itself.

use std::sync::Arc;

use tokio::sync::mpsc;

use crate::db::{self, ConversationId, RunId};

use super::Shared;

/// Conversations waiting for the waker; run tasks wait when it is full.
pub(super) const QUEUE_MAX: usize = 1024;
/// Conversations answered by one statement.
const BATCH_MAX: usize = 256;

pub(super) async fn run(shared: Arc<Shared>, mut ended: mpsc::Receiver<(RunId, ConversationId)>) {
    let mut batch = Vec::with_capacity(BATCH_MAX);
    // A connection of its own, as the finisher has (a pool pings each
    // connection given back, a second round trip per read); made when
    // first needed and again after an error.
    let mut conn = db::OwnConnection::new(&shared.pool);
    loop {
        tokio::select! {
            biased;
            n = ended.recv_many(&mut batch, BATCH_MAX) => if n == 0 { break },
            // Services stop after the last run task; answer what is queued, then go.
            _ = shared.stop_services.cancelled() => {
                ended.close();
                if ended.recv_many(&mut batch, BATCH_MAX).await == 0 {
                    break;
                }
            }
        }
        // The finisher tells a batch's run tasks at once and each sends its
        // conversation as it runs: one turn of the scheduler lets the rest
        // of them join this read (a drain made two reads per batch without).
        tokio::task::yield_now().await;
        while batch.len() < BATCH_MAX {
            match ended.try_recv() {
                Ok(one) => batch.push(one),
                Err(_) => break,
            }
        }
        let answered = match conn.get().await {
            Ok(c) => db::lifecycle::announce_ended(c, &batch).await,
            Err(e) => Err(e),
        };
        if let Err(e) = answered {
            // A lost hint costs a poll interval, nothing more.
            tracing::warn!(error = %e, "post-commit wake failed");
            conn.broke();
        }
        batch.clear();
    }
    conn.close().await;
}
