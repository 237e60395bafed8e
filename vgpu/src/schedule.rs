//! Who gets the card next, and for how long (pure: no I/O, no clock; tested directly).
//!
//! A card without MPS runs one context at a time and time-slices between contexts that have
//! work. The limiter makes that time-slicing deliberate: the containers ("tenants") of a card take
//! turns holding it through a lease, and only the holder launches. A lease's length is the
//! holder's share of a round; who goes next is decided by virtual time (stride scheduling): a
//! tenant's virtual time advances by the time it held the card divided by its weight (its
//! `CUDA_DEVICE_SM_LIMIT`), and the waiting tenant furthest behind goes first. What a holder
//! overran (its queued work finishing after its lease) is charged like the rest, so shares hold
//! over many leases whatever the workload's kernel lengths.
//!
//! Policies: `DEFAULT` is work-conserving (a share nobody uses goes to whoever wants it: only
//! waiting tenants compete). `FORCE` also caps a tenant at its share of wall time, alone or not,
//! through a credit that fills at its share.

/// One turn around the tenants of a card that all want it: each lease is its share of this.
pub const ROUND_NS: u64 = 40_000_000;
/// No lease is shorter (handing the card over costs a context switch and a wake-up).
pub const MIN_LEASE_NS: u64 = 2_000_000;
/// Weights are percent of the card.
pub const FULL_WEIGHT: u64 = 100;

/// A tenant's scheduling state, as the arbiter file holds it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tenant {
    /// Its share in percent, 1..=100 (values out of range are clamped: the file is shared).
    pub weight: u32,
    /// `FORCE`: capped at its share even when nobody else wants the card.
    pub force: bool,
    /// Time held, divided by the weight (scaled by [`FULL_WEIGHT`]).
    pub vtime: u64,
    /// `FORCE` only: nanoseconds of the card it may still take; fills at its share of wall time.
    pub credit_ns: i64,
    /// When the credit was last filled.
    pub credit_at_ns: u64,
    /// When it last held the card or was granted it; 0: never (a free record). A tenant active
    /// within the last round still competes (it waits again the moment its lease is over).
    pub last_active_ns: u64,
}

/// A process waiting for the card.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Waiter {
    /// Its slot in the arbiter.
    pub process: usize,
    /// Index into the tenants.
    pub tenant: usize,
    /// When it started waiting (ties go to the longest waiting).
    pub since_ns: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// This process holds the card for this long.
    Grant { process: usize, lease_ns: u64 },
    /// Waiters exist, but none may have the card before this time (`FORCE` credit).
    NotBefore(u64),
    /// Nobody waits.
    Nobody,
}

impl Tenant {
    pub fn weight(&self) -> u64 {
        (self.weight as u64).clamp(1, FULL_WEIGHT)
    }

    /// A `FORCE` tenant's lease: its share of a round (at least [`MIN_LEASE_NS`]).
    fn force_lease(&self) -> i64 {
        (ROUND_NS * self.weight() / FULL_WEIGHT).max(MIN_LEASE_NS) as i64
    }

    /// The most credit a `FORCE` tenant can save up: two leases, so that what it earns while it
    /// waits for another tenant's lease to end is not lost.
    fn credit_cap(&self) -> i64 {
        2 * self.force_lease()
    }

    /// Fills a `FORCE` tenant's credit for the time since it was last filled.
    pub fn refill(&mut self, now_ns: u64) {
        if !self.force {
            return;
        }
        let elapsed = now_ns.saturating_sub(self.credit_at_ns);
        let earned = (elapsed as u128 * self.weight() as u128 / FULL_WEIGHT as u128)
            .min(i64::MAX as u128) as i64;
        self.credit_ns = self.credit_ns.saturating_add(earned).min(self.credit_cap());
        self.credit_at_ns = now_ns.max(self.credit_at_ns);
    }

    /// A `FORCE` tenant waits for a whole lease's worth of credit (its share of a round): granted
    /// every sliver of credit as it came, it would hand the card over for every launch.
    fn eligible(&self) -> bool {
        !self.force || self.credit_ns >= self.force_lease()
    }

    /// When a `FORCE` tenant's credit reaches a whole lease (now if it has).
    fn eligible_at(&self, now_ns: u64) -> u64 {
        let missing = self.force_lease().saturating_sub(self.credit_ns);
        if !self.force || missing <= 0 {
            return now_ns;
        }
        now_ns + (missing as u64 * FULL_WEIGHT).div_ceil(self.weight())
    }

    /// Whether it held or waited for the card within the last round.
    pub fn active(&self, now_ns: u64) -> bool {
        self.last_active_ns != 0 && self.last_active_ns.saturating_add(ROUND_NS) >= now_ns
    }

    /// The holder used the card this long (its lease and any overrun), until `now_ns`.
    pub fn charge(&mut self, used_ns: u64, now_ns: u64) {
        self.last_active_ns = self.last_active_ns.max(now_ns);
        self.vtime = self
            .vtime
            .saturating_add(used_ns.saturating_mul(FULL_WEIGHT) / self.weight());
        if self.force {
            self.credit_ns = self
                .credit_ns
                .saturating_sub(used_ns.min(i64::MAX as u64) as i64);
        }
    }

    /// A tenant that starts competing again does not bring the credit of its idle time: it starts
    /// level with those already competing (`vclock`), never behind them.
    pub fn join(&mut self, vclock: u64) {
        self.vtime = self.vtime.max(vclock);
    }
}

/// A lease for a tenant of weight `weight` while tenants of `competing_weight` in all (itself
/// included) want the card: its share of a round. `FORCE` leases are also bounded by the credit.
pub fn lease_ns(tenant: &Tenant, competing_weight: u64) -> u64 {
    let share = ROUND_NS * tenant.weight() / competing_weight.max(tenant.weight());
    let mut lease = share.clamp(MIN_LEASE_NS, ROUND_NS);
    if tenant.force {
        // As long as its credit allows (up to two of its leases, to catch up after a wait).
        lease = lease
            .min(tenant.credit_ns.max(0) as u64)
            .max(MIN_LEASE_NS.min(tenant.credit_ns.max(0) as u64));
    }
    lease
}

/// The card is free: the waiting tenant furthest behind in virtual time (and may have it now)
/// gets it, its longest-waiting process holds the lease, for its share of a round among the
/// tenants active in the last round (the one that just gave the card up included: it is about to
/// wait again). A tenant that was idle before it started waiting joins level with the others
/// (`vclock`, the virtual time of the last grant, moves up to the granted tenant's).
pub fn decide(
    tenants: &mut [Tenant],
    waiters: &[Waiter],
    vclock: &mut u64,
    now_ns: u64,
) -> Decision {
    let count = tenants.len();
    let valid = move |w: &&Waiter| w.tenant < count;
    if !waiters.iter().any(|w| valid(&w)) {
        return Decision::Nobody;
    }
    for w in waiters.iter().filter(valid) {
        let tenant = &mut tenants[w.tenant];
        if !tenant.active(w.since_ns) {
            tenant.join(*vclock);
        }
        tenant.last_active_ns = tenant.last_active_ns.max(now_ns).max(1);
        tenant.refill(now_ns);
    }
    let competing_weight = competing_weight(tenants, now_ns);
    let best = waiters
        .iter()
        .filter(valid)
        .filter(|w| tenants[w.tenant].eligible())
        .min_by_key(|w| (tenants[w.tenant].vtime, w.since_ns, w.process));
    match best {
        Some(w) => {
            let tenant = &tenants[w.tenant];
            *vclock = (*vclock).max(tenant.vtime);
            Decision::Grant {
                process: w.process,
                lease_ns: lease_ns(tenant, competing_weight),
            }
        }
        None => Decision::NotBefore(
            waiters
                .iter()
                .filter(valid)
                .map(|w| tenants[w.tenant].eligible_at(now_ns))
                .min()
                .unwrap_or(now_ns),
        ),
    }
}

/// The holder's lease ran out and nobody else waits: how long it may go on (None: a `FORCE`
/// tenant out of credit must give the card up).
pub fn renew(tenant: &mut Tenant, competing_weight: u64, now_ns: u64) -> Option<u64> {
    tenant.refill(now_ns);
    if !tenant.eligible() {
        return None;
    }
    Some(lease_ns(tenant, competing_weight))
}

/// The holder's lease ran out while others wait: it keeps the card (a lease more) when its tenant
/// is still behind every waiting tenant in virtual time, as the scheduler would pick it again;
/// otherwise it gives the card up. Without this, two tenants would simply alternate, and what
/// each overran its leases by would skew their shares.
pub fn keeps_card(tenants: &mut [Tenant], holder: usize, waiters: &[Waiter], now_ns: u64) -> bool {
    if holder >= tenants.len() {
        return false;
    }
    tenants[holder].refill(now_ns);
    if !tenants[holder].eligible() {
        return false;
    }
    let own = tenants[holder].vtime;
    let count = tenants.len();
    waiters
        .iter()
        .filter(|w| w.tenant < count && w.tenant != holder)
        .all(|w| {
            let t = &mut tenants[w.tenant];
            t.refill(now_ns);
            !t.eligible() || own < t.vtime
        })
}

/// The weight of the tenants active within the last round.
pub fn competing_weight(tenants: &[Tenant], now_ns: u64) -> u64 {
    tenants
        .iter()
        .filter(|t| t.active(now_ns))
        .map(Tenant::weight)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn tenant(weight: u32, force: bool) -> Tenant {
        Tenant {
            weight,
            force,
            ..Tenant::default()
        }
    }

    /// A card whose tenants all want it all the time (one process each), run for `seconds` of
    /// simulated time: every holder overruns its lease by what `overrun` says (its queued work
    /// finishing) and every hand-over costs `switch_ns` of idle card. As in the arbiter, the card
    /// is decided at the moment its holder gives it up, when the holder is not waiting yet (it
    /// waits again right after). Returns each tenant's share of the card's time.
    fn simulate(
        tenants: &mut [Tenant],
        seconds: u64,
        switch_ns: u64,
        overrun: impl Fn(usize, u64) -> u64,
    ) -> Vec<f64> {
        let mut held = vec![0u64; tenants.len()];
        let mut now = 1;
        let mut vclock = 0;
        let mut waiting_since = vec![1u64; tenants.len()];
        let mut releasing: Option<usize> = None;
        let end = seconds * 1_000 * MS;
        let mut n = 0;
        while now < end {
            let waiters: Vec<Waiter> = (0..tenants.len())
                .filter(|&i| Some(i) != releasing)
                .map(|i| Waiter {
                    process: i,
                    tenant: i,
                    since_ns: waiting_since[i],
                })
                .collect();
            let competing = competing_weight(tenants, now);
            // At the end of a lease the holder renews when nobody waits, or when it is still the
            // furthest behind; otherwise the card is decided among the waiters.
            let renewed = releasing.and_then(|p| {
                if waiters.is_empty() || keeps_card(tenants, p, &waiters, now) {
                    renew(&mut tenants[p], competing, now).map(|lease_ns| Decision::Grant {
                        process: p,
                        lease_ns,
                    })
                } else {
                    None
                }
            });
            let decision = match renewed {
                Some(decision) => decision,
                None if waiters.is_empty() => {
                    releasing = None;
                    now += MS;
                    continue;
                }
                None => decide(tenants, &waiters, &mut vclock, now),
            };
            let switched =
                !matches!(decision, Decision::Grant { process, .. } if Some(process) == releasing);
            if switched {
                if let Some(r) = releasing.take() {
                    waiting_since[r] = now;
                }
            }
            match decision {
                Decision::Grant { process, lease_ns } => {
                    let used = lease_ns + overrun(process, n);
                    now += used;
                    held[process] += used;
                    tenants[process].charge(used, now);
                    releasing = Some(process);
                    if switched {
                        now += switch_ns;
                    }
                }
                Decision::NotBefore(t) => now = t.max(now + 1),
                Decision::Nobody => unreachable!(),
            }
            n += 1;
        }
        held.iter().map(|h| *h as f64 / now as f64).collect()
    }

    #[test]
    fn saturating_tenants_get_their_weights_whatever_they_overrun() {
        for weights in [[30, 70], [10, 90], [50, 50], [1, 99]] {
            let mut tenants = weights.map(|w| tenant(w, false));
            // Overruns of 0-7 ms, different for each tenant and lease (kernels of every length).
            let shares = simulate(&mut tenants, 60, 200_000, |p, n| {
                ((n * 7919 + p as u64 * 104_729) % 8) * MS
            });
            for (share, weight) in shares.iter().zip(weights) {
                // Hand-overs cost a little of the card; the split between tenants is exact.
                let expected = weight as f64 / 100.0 * (1.0 - 0.01);
                assert!(
                    (share - expected).abs() < 0.01,
                    "{weights:?}: {shares:?} (a hand-over idles the card for 0.2 ms)"
                );
            }
        }
    }

    #[test]
    fn three_tenants_split_by_weight() {
        let mut tenants = [tenant(20, false), tenant(30, false), tenant(50, false)];
        let shares = simulate(&mut tenants, 30, 0, |_, _| 0);
        for (share, weight) in shares.iter().zip([20, 30, 50]) {
            assert!((share - weight as f64 / 100.0).abs() < 0.005, "{shares:?}");
        }
    }

    #[test]
    fn a_force_tenant_alone_gets_its_share_of_wall_time() {
        for weight in [1, 10, 25, 70] {
            let mut tenants = [tenant(weight, true)];
            let shares = simulate(&mut tenants, 30, 0, |_, _| 0);
            assert!(
                (shares[0] - weight as f64 / 100.0).abs() < 0.005,
                "{weight}: {shares:?}"
            );
        }
    }

    #[test]
    fn a_force_tenant_overrunning_its_lease_pays_it_back() {
        let mut tenants = [tenant(25, true)];
        let shares = simulate(&mut tenants, 30, 0, |_, _| 3 * MS);
        assert!((shares[0] - 0.25).abs() < 0.01, "{shares:?}");
    }

    #[test]
    fn a_default_tenant_takes_what_a_force_tenant_leaves() {
        let mut tenants = [tenant(30, true), tenant(20, false)];
        let shares = simulate(&mut tenants, 30, 0, |_, _| 0);
        assert!((shares[0] - 0.30).abs() < 0.01, "{shares:?}");
        assert!((shares[1] - 0.70).abs() < 0.01, "{shares:?}");
    }

    #[test]
    fn leases_are_shares_of_a_round() {
        let t30 = tenant(30, false);
        assert_eq!(lease_ns(&t30, 100), 12 * MS);
        // Alone (or with weights summing under 100): the whole round.
        assert_eq!(lease_ns(&t30, 30), ROUND_NS);
        assert_eq!(lease_ns(&t30, 60), 20 * MS);
        // Never shorter than a hand-over is worth.
        assert_eq!(lease_ns(&tenant(1, false), 100), MIN_LEASE_NS);
    }

    #[test]
    fn a_tenant_that_was_idle_starts_level_with_the_others() {
        let mut busy = tenant(50, false);
        busy.charge(10_000 * MS, 10_000 * MS);
        let mut idle = tenant(50, false);
        let mut vclock = busy.vtime;
        idle.join(vclock);
        assert_eq!(idle.vtime, busy.vtime);
        // It does not lose what it had either.
        idle.vtime = vclock + 5;
        idle.join(vclock);
        assert_eq!(idle.vtime, vclock + 5);
        vclock = 0;
        let mut tenants = [busy, idle];
        let waiters = [
            Waiter {
                process: 0,
                tenant: 0,
                since_ns: 1,
            },
            Waiter {
                process: 1,
                tenant: 1,
                since_ns: 2,
            },
        ];
        assert!(matches!(
            decide(&mut tenants, &waiters, &mut vclock, 0),
            Decision::Grant { process: 0, .. }
        ));
        assert_eq!(vclock, tenants[0].vtime);
    }

    #[test]
    fn nobody_eligible_says_when_someone_will_be() {
        let mut t = tenant(10, true);
        t.credit_ns = 0;
        t.credit_at_ns = 1_000 * MS;
        let mut tenants = [t];
        let mut vclock = 0;
        let waiters = [Waiter {
            process: 3,
            tenant: 0,
            since_ns: 0,
        }];
        // A whole lease at 10 % (4 ms of a 40 ms round) is credited 40 ms later.
        assert_eq!(
            decide(&mut tenants, &waiters, &mut vclock, 1_000 * MS),
            Decision::NotBefore(1_040 * MS)
        );
        assert!(matches!(
            decide(&mut tenants, &waiters, &mut vclock, 1_040 * MS),
            Decision::Grant { process: 3, lease_ns } if lease_ns == 4 * MS
        ));
        assert_eq!(decide(&mut tenants, &[], &mut vclock, 0), Decision::Nobody);
    }

    #[test]
    fn renewing_follows_the_policy() {
        let mut default = tenant(30, false);
        assert_eq!(renew(&mut default, 30, 0), Some(ROUND_NS));
        assert_eq!(renew(&mut default, 100, 0), Some(12 * MS));
        let mut force = tenant(30, true);
        force.credit_at_ns = 0;
        assert_eq!(renew(&mut force, 30, 0), None, "no credit yet");
        assert_eq!(
            renew(&mut force, 30, 20 * MS),
            None,
            "half a lease of credit"
        );
        assert_eq!(renew(&mut force, 30, 40 * MS), Some(12 * MS));
        // Idle for long, it has saved up two leases, no more.
        force.credit_ns = 0;
        assert_eq!(renew(&mut force, 30, 1_000 * MS), Some(24 * MS));
    }

    #[test]
    fn a_tenant_idle_for_a_round_no_longer_shortens_the_others_leases() {
        let mut tenants = [tenant(30, false), tenant(70, false)];
        tenants[0].last_active_ns = 1_000 * MS;
        tenants[1].last_active_ns = 1_000 * MS;
        assert_eq!(competing_weight(&tenants, 1_000 * MS + ROUND_NS), 100);
        assert_eq!(competing_weight(&tenants, 1_001 * MS + ROUND_NS), 0);
        tenants[1].last_active_ns = 1_030 * MS;
        assert_eq!(competing_weight(&tenants, 1_001 * MS + ROUND_NS), 70);
    }

    #[test]
    fn garbage_from_the_shared_file_cannot_break_the_arithmetic() {
        let mut wild = Tenant {
            weight: u32::MAX,
            force: true,
            vtime: u64::MAX,
            credit_ns: i64::MIN,
            credit_at_ns: u64::MAX,
            last_active_ns: u64::MAX,
        };
        wild.refill(0);
        wild.charge(u64::MAX, u64::MAX);
        let _ = lease_ns(&wild, u64::MAX);
        let mut zero = Tenant::default();
        zero.charge(u64::MAX, 1);
        assert_eq!(zero.weight(), 1);
        let mut tenants = [wild, zero];
        let waiters = [
            Waiter {
                process: 0,
                tenant: 7,
                since_ns: 0,
            },
            Waiter {
                process: 1,
                tenant: 1,
                since_ns: 0,
            },
        ];
        let mut vclock = 0;
        assert!(matches!(
            decide(&mut tenants, &waiters, &mut vclock, 5),
            Decision::Grant { process: 1, .. }
        ));
    }
}
