//! The hub's bounds: a dropped subscription always unsubscribes (even when
//! the hub's command queue is full), subscribers whose receiver is gone are
//! pruned, and a channel left without subscribers is UNLISTENed at the
//! database, not only forgotten in the process.
//!
//! These tests run on tokio's current-thread runtime on purpose: while a test
//! drops subscriptions in a loop without yielding, the hub's supervisor cannot
//! run, so the command queue fills exactly as it would under a burst.

use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::support::*;
use agent_host::hub::{Hub, Wake, COMMAND_QUEUE_MAX};

const LONG: Duration = Duration::from_secs(10);

/// Waits until the hub counts `subscribers` subscribers over `channels` channels.
async fn wait_counts(hub: &Hub, subscribers: u64, channels: u64) {
    let h = hub.clone();
    wait_for(&format!("{subscribers} subscribers on {channels} channels"), LONG, || {
        let h = h.clone();
        async move { (h.stats().subscribers(), h.stats().channels()) == (subscribers, channels) }
    })
    .await;
}

/// Shows at the database that `gone` is no longer LISTENed on the hub's
/// connection: a NOTIFY on it, then one on `live` (a channel with a
/// subscriber), from one session in that order; once `live`'s wake arrives,
/// the hub has received exactly one notification more, so `gone`'s never
/// reached it.
async fn assert_unlistened(db: &TestDb, hub: &Hub, gone: &str, live: &str) {
    let mut probe = hub.subscribe(live).await;
    probe.drain();
    let before = hub.stats().notifications.load(Ordering::Relaxed);
    let mut conn = db.pool.acquire().await.unwrap();
    sqlx::query(&format!("NOTIFY {gone}, 'late'")).execute(&mut *conn).await.unwrap();
    sqlx::query(&format!("NOTIFY {live}, 'probe'")).execute(&mut *conn).await.unwrap();
    let wake = tokio::time::timeout(LONG, probe.recv()).await.expect("the probe's NOTIFY never arrived");
    assert_eq!(wake, Some(Wake::Notify("probe".into())));
    let after = hub.stats().notifications.load(Ordering::Relaxed);
    assert_eq!(after, before + 1, "the hub still LISTENs on {gone}: it received its NOTIFY");
}

#[tokio::test]
async fn dropped_subscriptions_unsubscribe_even_when_the_command_queue_is_full() {
    let db = TestDb::new().await;
    let hub = connected_hub(&db).await;
    // Twice what the command queue holds: under the old `try_send` in Drop,
    // every drop past the queue's capacity was lost.
    let n = 2 * COMMAND_QUEUE_MAX;
    let mut subs = Vec::with_capacity(n);
    for _ in 0..n {
        subs.push(hub.subscribe("hub_burst").await);
    }
    wait_counts(&hub, n as u64, 1).await;
    // One synchronous burst: the supervisor cannot run until it is over.
    drop(subs);
    wait_counts(&hub, 0, 0).await;
    assert_unlistened(&db, &hub, "hub_burst", "hub_probe").await;
}

#[tokio::test]
async fn a_subscribe_abandoned_before_its_ack_is_pruned() {
    let db = TestDb::new().await;
    let hub = connected_hub(&db).await;
    // Polled once, the subscribe sends its command and waits for the ack;
    // then it is dropped (as a caller's timeout or select would): its
    // receiver is gone before any `Subscription` reached the caller.
    let mut abandoned = Box::pin(hub.subscribe("hub_abandoned"));
    assert!(futures::poll!(&mut abandoned).is_pending(), "the subscribe finished within one poll");
    drop(abandoned);
    // Commands are handled in order: once this one is acked, the abandoned
    // subscribe has been handled too.
    let _live = hub.subscribe("hub_live").await;
    wait_counts(&hub, 1, 1).await;
    assert_unlistened(&db, &hub, "hub_abandoned", "hub_live").await;
}

#[tokio::test]
async fn one_channel_stays_listened_while_any_subscriber_remains() {
    let db = TestDb::new().await;
    let hub = connected_hub(&db).await;
    let first = hub.subscribe("hub_shared").await;
    let mut second = hub.subscribe("hub_shared").await;
    wait_counts(&hub, 2, 1).await;
    drop(first);
    wait_counts(&hub, 1, 1).await;
    sqlx::query("NOTIFY hub_shared, 'still'").execute(&db.pool).await.unwrap();
    let wake = tokio::time::timeout(LONG, second.recv()).await.expect("the remaining subscriber got no wake");
    assert_eq!(wake, Some(Wake::Notify("still".into())));
    drop(second);
    wait_counts(&hub, 0, 0).await;
}

/// Issue 43: a journal group commit NOTIFYs once on `run_events`, listing
/// the runs it wrote; the hub wakes the subscribers of exactly those runs'
/// channels (and of every run's for the "all" marker).
#[tokio::test]
async fn one_run_events_notify_wakes_the_runs_it_names() {
    use agent_host::db::notify::{events_channel, RUN_EVENTS, RUN_EVENTS_ALL};
    use agent_host::db::RunId;
    let db = TestDb::new().await;
    let hub = connected_hub(&db).await;
    let runs: Vec<RunId> = (0..3).map(|_| RunId(uuid::Uuid::new_v4())).collect();
    let mut subs = Vec::new();
    for r in &runs {
        subs.push(hub.subscribe(&events_channel(*r)).await);
    }
    let named = format!("{},{}", runs[0].0.simple(), runs[1].0.simple());
    let mut conn = db.pool.acquire().await.unwrap();
    sqlx::query("SELECT pg_notify($1, $2)").bind(RUN_EVENTS).bind(&named).execute(&mut *conn).await.unwrap();
    // Then one on the third run's own channel: it must be that run's first wake.
    sqlx::query("SELECT pg_notify($1, 'own')").bind(events_channel(runs[2])).execute(&mut *conn).await.unwrap();
    for s in &mut subs[..2] {
        let wake = tokio::time::timeout(LONG, s.recv()).await.expect("a named run was not woken");
        assert_eq!(wake, Some(Wake::Notify(RUN_EVENTS.into())));
    }
    let wake = tokio::time::timeout(LONG, subs[2].recv()).await.expect("no wake");
    assert_eq!(wake, Some(Wake::Notify("own".into())), "a run the NOTIFY did not name was woken");
    sqlx::query("SELECT pg_notify($1, $2)").bind(RUN_EVENTS).bind(RUN_EVENTS_ALL).execute(&mut *conn).await.unwrap();
    for s in &mut subs {
        let wake = tokio::time::timeout(LONG, s.recv()).await.expect("the all marker missed a run");
        assert_eq!(wake, Some(Wake::Notify(RUN_EVENTS.into())));
    }
    // RUN_EVENTS is not counted as a subscribed channel.
    wait_counts(&hub, 3, 3).await;
}
