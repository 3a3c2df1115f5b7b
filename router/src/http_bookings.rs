//! The bookings `POST /route` clients hold ([`crate::cluster::Cluster::route_booked`]).
//!
//! Why apart from the router's own books: these are made and ended by clients over HTTP, so
//! what they may hold is bounded here. A client that books and never reports holds its
//! prompt's pages in the router's queue model until the booking expires (its time to live);
//! a client that books huge prompts quickly held memory without limit (1M-token prompts:
//! 250 MB for 400 bookings). So the pages all open bookings hold are capped
//! ([`MAX_BOOKED_PAGES`] by default): past the cap the oldest bookings are dropped, as if
//! expired (their clients' later reports find nothing).
//!
//! And their number is capped ([`MAX_OPEN_BOOKINGS_PER_INSTANCE`] per instance, all
//! instances' together): every routing decision replays each instance's open bookings on its
//! timeline ([`crate::feedback::Feedback::queue_s`]), so a decision costs time in proportion
//! to them. Bookings of prompts shorter than a page hold no pages, and the page cap never
//! dropped them: 50,000 left open by one client made every `/route` take 8.4 ms, and making
//! them took time quadratic in their number. Past the cap the oldest is dropped, as if
//! expired.

use std::collections::{HashMap, VecDeque};

use crate::cluster::{Cluster, Decision, Report};
use crate::feedback::FirstToken;

/// Default cap on the prompt pages open `POST /route` bookings hold together: 2^21 pages
/// (32M tokens at 16-token pages), some 80 MB of the router's queue books.
pub const MAX_BOOKED_PAGES: usize = 1 << 21;

/// Default cap on open `POST /route` bookings, per instance of the router (the cap is this
/// times the instances, shared): past an engine's running batch and its waiting queue (vLLM
/// runs at most 256 sequences at once by default).
pub const MAX_OPEN_BOOKINGS_PER_INSTANCE: usize = 1024;

#[derive(Debug, Clone, Copy)]
struct Open {
    /// Its first token is still to be reported.
    awaiting_first: bool,
    pages: usize,
}

/// Open `POST /route` bookings, their deadlines and the pages they hold.
#[derive(Debug)]
pub(crate) struct HttpBookings {
    open: HashMap<u64, Open>,
    /// Deadlines in the order made (one time to live: also in deadline order).
    deadlines: VecDeque<(f64, u64)>,
    pub(crate) ttl_s: f64,
    pages: usize,
    pub(crate) max_pages: usize,
    /// The most bookings open at once.
    pub(crate) max_open: usize,
    pub(crate) expired: u64,
    pub(crate) evicted: u64,
}

impl HttpBookings {
    pub(crate) fn new(ttl_s: f64, instances: usize) -> Self {
        HttpBookings {
            open: HashMap::new(),
            deadlines: VecDeque::new(),
            ttl_s,
            pages: 0,
            max_pages: MAX_BOOKED_PAGES,
            max_open: MAX_OPEN_BOOKINGS_PER_INSTANCE.saturating_mul(instances.max(1)),
            expired: 0,
            evicted: 0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.open.len()
    }

    /// Prompt pages the open bookings hold.
    pub(crate) fn pages(&self) -> usize {
        self.pages
    }

    /// Books `id`, holding `pages`: the bookings dropped to stay within the caps, oldest
    /// first; `None` (nothing booked, nothing dropped) when it alone is past the cap.
    pub(crate) fn book(
        &mut self,
        id: u64,
        awaiting_first: bool,
        pages: usize,
        now_s: f64,
    ) -> Option<Vec<u64>> {
        if pages > self.max_pages {
            return None;
        }
        self.open.insert(
            id,
            Open {
                awaiting_first,
                pages,
            },
        );
        self.pages += pages;
        self.deadlines.push_back((now_s + self.ttl_s, id));
        let mut dropped = Vec::new();
        while self.pages > self.max_pages || self.open.len() > self.max_open {
            let Some((_, old)) = self.deadlines.pop_front() else {
                break;
            };
            if self.end(old) {
                self.evicted += 1;
                dropped.push(old);
            }
        }
        Some(dropped)
    }

    /// Takes the booking's first token: `Some(true)` the first time, `Some(false)` after
    /// (or when it was booked with its first token unseen), `None` if it is not open.
    pub(crate) fn first_token(&mut self, id: u64) -> Option<bool> {
        self.open
            .get_mut(&id)
            .map(|o| std::mem::take(&mut o.awaiting_first))
    }

    /// Ends the booking; `false` if it was not open.
    pub(crate) fn end(&mut self, id: u64) -> bool {
        match self.open.remove(&id) {
            Some(o) => {
                self.pages -= o.pages;
                true
            }
            None => false,
        }
    }

    /// The bookings due at `now_s`, ended (counted `expired`).
    pub(crate) fn expire(&mut self, now_s: f64) -> Vec<u64> {
        let mut out = Vec::new();
        while let Some(&(due, id)) = self.deadlines.front() {
            let open = self.open.contains_key(&id);
            if open && due > now_s {
                break;
            }
            self.deadlines.pop_front(); // ended already, or due
            if self.end(id) {
                out.push(id);
            }
        }
        self.expired += out.len() as u64;
        out
    }
}

/// The `POST /route` clients' side of the [`Cluster`]: booking, reports and expiry.
impl Cluster {
    /// How long a `POST /route` booking lasts without its end ([`crate::cluster::BOOKING_TTL_S`] by
    /// default); a time that is not a positive number of seconds is refused.
    pub fn set_booking_ttl_s(&mut self, ttl_s: f64) -> Result<(), crate::RouteError> {
        if !(ttl_s.is_finite() && ttl_s > 0.0) {
            return Err(crate::RouteError::BadBookingTtl(ttl_s.to_string()));
        }
        self.http.ttl_s = ttl_s;
        Ok(())
    }

    /// The most prompt pages open `POST /route` bookings hold together
    /// ([`MAX_BOOKED_PAGES`] by default); past it the oldest are
    /// dropped, as if expired (counted `http_evicted` in `/stats`).
    pub fn set_max_booked_pages(&mut self, pages: usize) {
        self.http.max_pages = pages;
    }

    /// The most `POST /route` bookings open at once
    /// ([`MAX_OPEN_BOOKINGS_PER_INSTANCE`] times the instances by default, at least 1); past
    /// it the oldest are dropped, as if expired (counted `http_evicted`).
    pub fn set_max_open_bookings(&mut self, bookings: usize) {
        self.http.max_open = bookings.max(1);
    }

    /// [`Self::route_tracked`] for a client that reports over HTTP ([`Self::report`]): the
    /// booking expires [`Self::set_booking_ttl_s`] after it is made unless it ended before.
    pub fn route_booked(
        &mut self,
        tokens: &[u32],
        scope: (Option<&str>, Option<&str>),
        output: usize,
        first: FirstToken,
    ) -> Option<Decision> {
        let hashes = self.prompt_hashes(tokens, scope.0, scope.1);
        self.route_booked_hashed(&hashes, tokens.len(), output, first)
    }

    /// [`Self::route_booked`] of a prompt of `tokens` tokens keyed already
    /// ([`crate::cluster::Keyer::hashes`]).
    pub fn route_booked_hashed(
        &mut self,
        hashes: &[u64],
        tokens: usize,
        output: usize,
        first: FirstToken,
    ) -> Option<Decision> {
        let mut d = self.route_tracked_hashed(hashes, tokens, &[], output, first)?;
        if let Some(id) = d.booking {
            let pages = tokens / self.page_size.max(1);
            let now = self.now_s();
            match self
                .http
                .book(id, first == FirstToken::Reported, pages, now)
            {
                Some(dropped) => {
                    for old in dropped {
                        self.router.cancel(old);
                    }
                }
                None => {
                    // alone past the cap: routed, not booked
                    self.router.cancel(id);
                    d.booking = None;
                }
            }
        }
        Some(d)
    }

    /// A `POST /route` client's report on its booking; `false` (nothing changes) for a
    /// booking that is not one of theirs, has ended, or expired — or a first token already
    /// reported, or of a booking made with its first token unseen
    /// ([`FirstToken::AtEstimate`]). Only bookings made by [`Self::route_booked`] are
    /// reported on this way: the proxy's own bookings cannot be ended by a client guessing
    /// numbers.
    pub fn report(&mut self, booking: u64, what: Report) -> bool {
        self.expire_bookings();
        let now = self.now_s();
        match what {
            Report::FirstToken => {
                self.http.first_token(booking) == Some(true)
                    && self.router.first_token(booking, now)
            }
            Report::End => self.http.end(booking) && self.router.finished(booking, now),
            Report::Cancel => self.http.end(booking) && self.router.cancel(booking),
        }
    }

    /// Drops the `POST /route` bookings past their time to live, learning nothing from
    /// them (when they really ended is unknown); how many.
    pub fn expire_bookings(&mut self) -> usize {
        let now = self.now_s();
        let due = self.http.expire(now);
        for &id in &due {
            self.router.cancel(id);
        }
        // and the background responses' bookings past their deadline (`Cluster::background`)
        for id in self.background.expire((now * 1e9) as u64) {
            self.router.cancel(id);
        }
        due.len()
    }
}
