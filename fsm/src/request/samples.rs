//! Representative states and events of every kind: [`RequestStateKind::samples`] and
//! [`RequestEventKind::samples`].
//!
//! Why: the transition table is checked against the code on concrete values. Samples that put
//! counters at their edges (0, 1, `u32::MAX`) and take every flag both ways let the
//! reachability check, this crate's tests and downstream crates' tests cover the edges of
//! every kind without each building its own states by hand.

use super::{FailReason, RequestEvent, RequestEventKind, RequestState, RequestStateKind};

impl RequestStateKind {
    /// Representative, internally consistent states of this kind: plain values, both values of
    /// every flag, and counters at their edges (0, 1, `u32::MAX`). Tests, the reachability check
    /// and downstream crates' tests use these.
    pub fn samples(self) -> Vec<RequestState> {
        use RequestState as S;
        const M: u32 = u32::MAX;
        let flags = [false, true];
        match self {
            Self::Submitted => vec![S::Submitted],
            Self::Querying => flags
                .iter()
                .map(|&abort_pending| S::Querying { abort_pending })
                .collect(),
            Self::Prefetching => [(0, 1), (2, 4), (0, M), (M - 1, 1)]
                .iter()
                .flat_map(|&(start_page, pages)| {
                    flags.iter().map(move |&abort_pending| S::Prefetching {
                        start_page,
                        pages,
                        abort_pending,
                    })
                })
                .collect(),
            Self::PrefetchDone => [(0, 0), (2, 3), (0, M), (M, 0)]
                .iter()
                .map(|&(start_page, completed)| S::PrefetchDone {
                    start_page,
                    completed,
                })
                .collect(),
            Self::Prefilling => {
                let p = |total, done, scheduled, chunks, abort_pending| S::Prefilling {
                    total,
                    done,
                    scheduled,
                    chunks,
                    abort_pending,
                };
                vec![
                    p(8, 0, 4, 1, false),
                    p(8, 0, 4, 1, true),
                    p(8, 4, 4, 1, false),
                    p(8, 4, 8, 2, false),
                    p(8, 4, 8, 2, true),
                    p(8, 2, 2, M, false),
                    p(M, M - 1, M - 1, 3, false),
                    p(M, 0, M, 1, false),
                ]
            }
            Self::Decoding => vec![
                S::Decoding {
                    generated: 1,
                    in_flight: false,
                    abort_pending: false,
                },
                S::Decoding {
                    generated: 5,
                    in_flight: true,
                    abort_pending: false,
                },
                S::Decoding {
                    generated: 5,
                    in_flight: true,
                    abort_pending: true,
                },
                S::Decoding {
                    generated: M - 1,
                    in_flight: true,
                    abort_pending: false,
                },
                S::Decoding {
                    generated: M,
                    in_flight: false,
                    abort_pending: false,
                },
            ],
            Self::Draining => [0, 3].iter().map(|&pages| S::Draining { pages }).collect(),
            Self::WritingBack => flags
                .iter()
                .map(|&abort_pending| S::WritingBack {
                    pages: 3,
                    abort_pending,
                })
                .collect(),
            Self::BackingUp => [1, 2]
                .iter()
                .flat_map(|&outstanding| {
                    flags.iter().map(move |&abort_pending| S::BackingUp {
                        outstanding,
                        abort_pending,
                    })
                })
                .collect(),
            Self::Retracting => flags
                .iter()
                .map(|&abort_pending| S::Retracting {
                    pages: 2,
                    abort_pending,
                })
                .collect(),
            Self::Retracted => flags.iter().map(|&saved| S::Retracted { saved }).collect(),
            Self::Finished => vec![S::Finished],
            Self::Aborted => vec![S::Aborted],
            Self::Failed => [
                FailReason::OpFailed,
                FailReason::OutOfMemory,
                FailReason::Internal,
            ]
            .iter()
            .map(|&reason| S::Failed { reason })
            .collect(),
        }
    }
}

impl RequestEventKind {
    /// Representative events of this kind, legal and illegal alike: zero counts, small counts,
    /// bounds-breaking and overflowing counts, every flag combination.
    pub fn samples(self) -> Vec<RequestEvent> {
        use RequestEvent as E;
        const M: u32 = u32::MAX;
        match self {
            Self::ScheduleQuery => vec![E::ScheduleQuery],
            Self::QueryDone => [0, 5]
                .iter()
                .map(|&hit_pages| E::QueryDone { hit_pages })
                .collect(),
            Self::SchedulePrefetch => [(0, 0), (0, 1), (2, 4), (0, M), (M, 1)]
                .iter()
                .map(|&(start_page, pages)| E::SchedulePrefetch { start_page, pages })
                .collect(),
            Self::PrefetchDone => [0, 1, 4, M]
                .iter()
                .map(|&completed| E::PrefetchDone { completed })
                .collect(),
            Self::ScheduleFirstChunk => [
                (8, 0, 4),
                (8, 4, 4),
                (8, 0, 8),
                (8, 7, 1),
                (8, 0, 0),
                (8, 4, 5),
                (M, M, 1),
            ]
            .iter()
            .map(|&(total, cached, tokens)| E::ScheduleFirstChunk {
                total,
                cached,
                tokens,
            })
            .collect(),
            Self::ScheduleNextChunk => [0, 1, 4, M]
                .iter()
                .map(|&tokens| E::ScheduleNextChunk { tokens })
                .collect(),
            Self::PrefillDone => vec![E::PrefillDone],
            Self::ScheduleDecode => vec![E::ScheduleDecode],
            Self::DecodeStep => vec![E::DecodeStep],
            Self::Finish => [0, 3]
                .iter()
                .map(|&pages_to_write_back| E::Finish {
                    pages_to_write_back,
                })
                .collect(),
            Self::CommitDraining => vec![E::CommitDraining],
            Self::WriteBackDone => [(true, 0), (false, 0), (true, 2), (false, 2)]
                .iter()
                .map(|&(success, backups)| E::WriteBackDone { success, backups })
                .collect(),
            Self::BackupDone => vec![E::BackupDone],
            Self::Retract => [0, 3]
                .iter()
                .map(|&write_back_pages| E::Retract { write_back_pages })
                .collect(),
            Self::ResumeFromRetracted => vec![E::ResumeFromRetracted],
            Self::Abort => vec![E::Abort],
            Self::Fail => [
                FailReason::OpFailed,
                FailReason::OutOfMemory,
                FailReason::Internal,
            ]
            .iter()
            .map(|&reason| E::Fail { reason })
            .collect(),
        }
    }
}
