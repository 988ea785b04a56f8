//! A tenant's share of this process's run slots: no tenant holds every slot.
//!
//! Fair claims order the queue by each tenant's load, but a run, once
//! started, keeps its slot until it ends: a tenant alone on a host would
//! otherwise fill every slot of every process with long runs, and a tenant
//! arriving next would wait for one of them to end. So each process keeps
//! part of its slots back from any one tenant: a tenant may hold at most its
//! share of the process's slots (`--tenant-slot-share-pct`, 75 by default,
//! rounded up, at least one, and below 100% one fewer than all at most; the
//! operator sets a share per tenant with
//! `agent-host tenants share`). Every process keeps the rest free for the
//! others, so a tenant arriving while another holds all it may gets a slot
//! at the next claim (a wake: milliseconds; at worst the poll tick).
//!
//! The count is this process's own: the runs it holds (`Shared::held`, by
//! tenant) and the rows claims in flight may still take (each reserves its
//! limit until its runs are held). Claims and eager starts read the rooms
//! left ([`Rooms`]); a tenant at its share is passed over, its runs stay
//! queued for a process with room, and nothing is refused.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};

use crate::db::lifecycle::Rooms;

/// The share of a process's slots one tenant may hold, in percent.
pub const TENANT_SLOT_SHARE_PCT_DEFAULT: u8 = 75;

/// Shares and the claims in flight of one worker.
#[derive(Debug)]
pub(crate) struct Shares {
    /// The process's slots (`--max-runs`).
    slots: usize,
    default_pct: u8,
    /// The operator's per-tenant shares, read from the database on each heartbeat.
    overrides: RwLock<HashMap<String, u8>>,
    /// Rows the claims in flight may still take (the sum of their limits).
    pending: Mutex<usize>,
}

impl Shares {
    pub fn new(slots: usize, default_pct: u8) -> Self {
        Shares { slots, default_pct, overrides: RwLock::default(), pending: Mutex::new(0) }
    }

    /// The runs `tenant` may hold on this process at most.
    #[cfg(test)]
    pub fn cap(&self, tenant: &str) -> usize {
        self.cap_in(&self.overrides.read().unwrap(), tenant)
    }

    /// [`Shares::cap`] with the operator's shares already read: the read
    /// lock is taken once per claim (taken twice, the second could wait
    /// forever behind a writer waiting for the first).
    fn cap_in(&self, overrides: &HashMap<String, u8>, tenant: &str) -> usize {
        cap_of(self.slots, overrides.get(tenant).copied().unwrap_or(self.default_pct))
    }

    /// Replaces the operator's shares (percent, 1-100; others are ignored);
    /// locked for writing only when they changed.
    pub fn set_overrides(&self, shares: impl IntoIterator<Item = (String, i32)>) {
        let map: HashMap<String, u8> = shares
            .into_iter()
            .filter_map(|(t, p)| u8::try_from(p).ok().filter(|p| (1..=100).contains(p)).map(|p| (t, p)))
            .collect();
        if *self.overrides.read().unwrap() != map {
            *self.overrides.write().unwrap() = map;
        }
    }

    /// The rooms for a claim of up to `limit` rows, given the runs this
    /// process holds by tenant, and a reservation of those rows that lasts
    /// until it is dropped (after the claimed runs are held).
    pub fn reserve(
        self: &Arc<Self>,
        limit: usize,
        held: impl FnOnce() -> HashMap<String, usize>,
    ) -> (Rooms, Reservation) {
        let pending = {
            let mut p = self.pending.lock().unwrap();
            let before = *p;
            *p += limit;
            before
        };
        let reservation = Reservation { shares: self.clone(), rows: limit };
        let overrides = self.overrides.read().unwrap();
        // Every tenant may take every slot: nothing to count on the claim's path.
        if self.default_pct == 100 && overrides.is_empty() {
            return (Rooms::default(), reservation);
        }
        // Counted after the reservation (see `Shared::reserve`).
        let held = &held();
        let room = |tenant: &str| {
            let holds = held.get(tenant).copied().unwrap_or(0);
            self.cap_in(&overrides, tenant).saturating_sub(holds + pending) as i64
        };
        let limit = limit as i64;
        let mut rooms = Rooms::default();
        let default = cap_of(self.slots, self.default_pct).saturating_sub(pending) as i64;
        rooms.default = (default < limit).then_some(default);
        // A tenant is named when its room differs from what an unnamed one gets.
        let unnamed = default.min(limit);
        for tenant in held.keys().chain(overrides.keys()) {
            let r = room(tenant).min(limit);
            if r != unnamed && !rooms.tenants.contains(tenant) {
                rooms.tenants.push(tenant.clone());
                rooms.slots.push(r);
            }
        }
        drop(overrides);
        (rooms, reservation)
    }
}

/// `pct` percent of `slots`, rounded up, at least one; below 100%, one slot
/// fewer than all at most (a process of 2 or 3 slots keeps one back too).
fn cap_of(slots: usize, pct: u8) -> usize {
    let cap = (slots * usize::from(pct)).div_ceil(100).max(1);
    match slots > 1 && pct < 100 {
        true => cap.min(slots - 1),
        false => cap,
    }
}

/// Rows a claim in flight may still take; given back when dropped.
#[derive(Debug)]
pub(crate) struct Reservation {
    shares: Arc<Shares>,
    rows: usize,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut p = self.shares.pending.lock().unwrap();
        *p = p.saturating_sub(self.rows);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(pairs: &[(&str, usize)]) -> HashMap<String, usize> {
        pairs.iter().map(|(t, n)| (t.to_string(), *n)).collect()
    }

    #[test]
    fn the_share_rounds_up_and_is_never_zero() {
        assert_eq!(cap_of(16, 75), 12);
        assert_eq!(cap_of(4, 75), 3);
        assert_eq!(cap_of(2, 75), 1, "a share below 100% keeps a slot back");
        assert_eq!(cap_of(3, 99), 2);
        assert_eq!(cap_of(2, 100), 2);
        assert_eq!(cap_of(1, 1), 1);
        assert_eq!(cap_of(16, 100), 16);
    }

    #[test]
    fn a_claim_far_from_every_share_binds_nothing() {
        let shares = Arc::new(Shares::new(16, 75));
        let (rooms, _r) = shares.reserve(4, || held(&[("a", 2)]));
        assert!(!rooms.bind(4), "{rooms:?}");
    }

    #[test]
    fn a_tenant_at_its_share_gets_no_room_and_others_keep_theirs() {
        let shares = Arc::new(Shares::new(4, 75));
        let (rooms, _r) = shares.reserve(1, || held(&[("evil", 3)]));
        assert_eq!(rooms.tenants, vec!["evil".to_string()]);
        assert_eq!(rooms.slots, vec![0]);
        assert_eq!(rooms.default, None, "a tenant holding nothing may take the one row");
    }

    #[test]
    fn claims_in_flight_count_against_every_tenant_until_dropped() {
        let shares = Arc::new(Shares::new(4, 75));
        let (_, first) = shares.reserve(2, || held(&[]));
        let (rooms, second) = shares.reserve(2, || held(&[]));
        assert_eq!(rooms.default, Some(1), "3 allowed, 2 may be taken by the claim in flight");
        drop((first, second));
        let (rooms, _r) = shares.reserve(2, || held(&[]));
        assert_eq!(rooms.default, None);
    }

    /// The heartbeat replaces the shares while claims read them: a claim
    /// that took the read lock twice could wait forever behind the writer
    /// waiting for its first (every worker thread of a process stopped so).
    #[test]
    fn shares_replaced_while_claims_read_them_never_deadlock() {
        let shares = Arc::new(Shares::new(16, 75));
        let writer = {
            let shares = shares.clone();
            std::thread::spawn(move || {
                for i in 0..20_000 {
                    shares.set_overrides([("t".to_string(), 10 + (i % 2))]);
                }
            })
        };
        let reader = {
            let shares = shares.clone();
            std::thread::spawn(move || {
                for _ in 0..20_000 {
                    let (_rooms, _r) = shares.reserve(4, || held(&[("a", 1), ("t", 1)]));
                }
            })
        };
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            writer.join().unwrap();
            reader.join().unwrap();
            let _ = done_tx.send(());
        });
        done_rx.recv_timeout(std::time::Duration::from_secs(60)).expect("the shares deadlocked");
    }

    #[test]
    fn an_operator_share_names_its_tenant() {
        let shares = Arc::new(Shares::new(4, 75));
        shares.set_overrides([("big".to_string(), 100), ("small".to_string(), 25), ("bad".to_string(), 0)]);
        let (rooms, _r) = shares.reserve(2, || held(&[("big", 3), ("small", 0)]));
        let named: HashMap<_, _> = rooms.tenants.iter().cloned().zip(rooms.slots.iter().copied()).collect();
        assert_eq!(named.get("big"), Some(&1));
        assert_eq!(named.get("small"), Some(&1));
        assert!(!named.contains_key("bad"));
        assert_eq!(shares.cap("bad"), 3, "an out-of-range share is ignored");
    }
}
