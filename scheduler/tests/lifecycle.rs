//! Retraction, abort from every state, bad input, determinism and observability.

mod common;
use common::*;
use kvtier_fsm::RequestStateKind;
use kvtier_scheduler::*;

#[test]
fn retraction_under_device_pressure_writes_back_and_resumes_with_load_back() {
    let mut c = cfg();
    c.device_pages = 24;
    c.max_context_tokens = 96;
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut e = Engine::new(&c);
    for i in 0..4 {
        e.submit(&mut s, i, prompt(i as u32 + 1, 20), 40);
    }
    e.run_to_idle(&mut s, 2000);
    let st = s.stats();
    assert!(
        st.retracted > 0,
        "device pressure forced retraction: {st:?}"
    );
    assert_eq!(st.finished, 4);
    assert!(
        st.op(OpKind::LoadBack).succeeded > 0,
        "resumed with load-back: {st:?}"
    );
    assert_eq!(
        st.host_hit_pages, 0,
        "a resumed request's own pages are not prefix hits"
    );
    for i in 0..4 {
        assert_eq!(e.tokens[&RequestId(i)].len(), 60);
    }
    assert_quiescent(&s);
}

#[test]
fn retraction_without_host_recomputes() {
    let mut c = cfg();
    c.device_pages = 24;
    c.max_context_tokens = 96;
    c.host_enabled = false;
    c.host_pages = 0;
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut e = Engine::new(&c);
    for i in 0..4 {
        e.submit(&mut s, i, prompt(i as u32 + 1, 20), 40);
    }
    e.run_to_idle(&mut s, 2000);
    let st = s.stats();
    assert!(st.retracted > 0);
    assert_eq!(st.finished, 4);
    assert_eq!(st.op(OpKind::WriteBack).issued, 0);
    assert_quiescent(&s);
}

#[test]
fn retraction_policies_pick_different_victims() {
    for policy in [
        RetractionPolicy::LatestArrival,
        RetractionPolicy::FewestGenerated,
        RetractionPolicy::MostPages,
    ] {
        let mut c = cfg();
        c.device_pages = 24;
        c.max_context_tokens = 96;
        c.retraction = policy;
        let mut s = Scheduler::new(c.clone()).unwrap();
        let mut e = Engine::new(&c);
        for i in 0..4 {
            e.submit(&mut s, i, prompt(i as u32 + 1, 12 + 4 * i as usize), 40);
        }
        e.run_to_idle(&mut s, 3000);
        assert_eq!(s.stats().finished, 4, "{policy:?}");
        assert_quiescent(&s);
    }
}

/// Drives request 1 until `pred` holds for its state, holding back ops (not completing them),
/// aborts it, then completes everything: it must end Aborted with everything released.
fn abort_when(c: SchedulerConfig, l3: bool, want: RequestStateKind) {
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut e = Engine::new(&c);
    if l3 {
        // Seed L3 so the request probes and prefetches.
        let mut s0 = Scheduler::new(c.clone()).unwrap();
        let mut e0 = Engine::new(&c);
        e0.submit(&mut s0, 99, prompt(1, 41), 1);
        e0.run_to_idle(&mut s0, 200);
        e.l3 = e0.l3;
    }
    e.submit(&mut s, 1, prompt(1, 41), 6);
    let id = RequestId(1);
    let mut reached = false;
    for t in 0..400 {
        let kind = s.request_state(id).map(|st| st.kind());
        if kind == Some(want) {
            reached = true;
            break;
        }
        if kind.is_none() {
            break;
        }
        // Alternate: plan, then complete one thing at a time so every state is observable.
        if e.held.is_empty() && e.forward.is_none() {
            let plan = s.next_execution_plan(t);
            e.take_plan(plan);
        } else if !e.held.is_empty() {
            e.complete_op(&mut s, 0);
        } else if e.forward_ready() {
            e.complete_forward(&mut s);
        }
    }
    assert!(reached, "never reached {want}");
    s.abort(id).expect("abort accepted");
    assert!(
        matches!(
            s.abort(id),
            Err(SchedulerError::IllegalEvent { .. }) | Err(SchedulerError::UnknownRequest(_))
        ),
        "a second abort is reported"
    );
    e.run_to_idle(&mut s, 400);
    assert!(
        e.ended.contains(&(id, Outcome::Aborted)),
        "{want}: {:?}",
        e.ended
    );
    assert_quiescent(&s);
}

#[test]
fn abort_from_every_state_releases_everything_once() {
    let base = cfg();
    let l3 = SchedulerConfig {
        l3_enabled: true,
        prefetch_threshold: 2,
        prefetch_stop: PrefetchStopPolicy::WaitComplete,
        ..cfg()
    };
    let mut small_chunks = cfg();
    small_chunks.chunked_prefill_size = 8;
    for (c, l3on, st) in [
        (base.clone(), false, RequestStateKind::Submitted),
        (small_chunks.clone(), false, RequestStateKind::Prefilling),
        (base.clone(), false, RequestStateKind::Decoding),
        (base.clone(), false, RequestStateKind::WritingBack),
        (l3.clone(), true, RequestStateKind::Querying),
        (l3.clone(), true, RequestStateKind::Prefetching),
        (l3.clone(), true, RequestStateKind::PrefetchDone),
        (l3.clone(), false, RequestStateKind::BackingUp),
    ] {
        abort_when(c, l3on, st);
    }
}

#[test]
fn abort_of_retracted_request() {
    let mut c = cfg();
    c.device_pages = 24;
    c.max_context_tokens = 96;
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut e = Engine::new(&c);
    for i in 0..4 {
        e.submit(&mut s, i, prompt(i as u32 + 1, 20), 40);
    }
    let mut aborted = None;
    for t in 0..3000 {
        if aborted.is_none() {
            for i in 0..4 {
                if matches!(
                    s.request_state(RequestId(i)).map(|x| x.kind()),
                    Some(RequestStateKind::Retracted | RequestStateKind::Retracting)
                ) {
                    s.abort(RequestId(i)).unwrap();
                    aborted = Some(RequestId(i));
                    break;
                }
            }
        }
        if s.is_idle() {
            break;
        }
        e.step(&mut s, t);
    }
    e.run_to_idle(&mut s, 100);
    let a = aborted.expect("some request was retracted");
    assert!(e.ended.contains(&(a, Outcome::Aborted)));
    assert_quiescent(&s);
}

/// Two schedulers fed identical calls produce identical plans; one of them also receives a bad
/// event, which must be rejected with a typed error and change nothing (the plans stay equal).
#[test]
fn bad_input_is_rejected_and_changes_nothing() {
    let c = SchedulerConfig {
        l3_enabled: true,
        prefetch_threshold: 2,
        ..cfg()
    };
    let mut a = Scheduler::new(c.clone()).unwrap();
    let mut b = Scheduler::new(c.clone()).unwrap();
    let mut ea = Engine::new(&c);
    let mut eb = Engine::new(&c);
    for (i, len) in [(1u64, 30usize), (2, 45), (3, 9)] {
        ea.submit(&mut a, i, prompt(i as u32, len), 5);
        eb.submit(&mut b, i, prompt(i as u32, len), 5);
    }
    let bad = |s: &mut Scheduler, plan: &ExecutionPlan| {
        let mut errs = vec![
            s.abort(RequestId(77)).unwrap_err(),
            s.on_event(Event::LoadBackDone {
                op: OpId(1 << 40),
                success: true,
            })
            .unwrap_err(),
            s.on_event(Event::ForwardDone {
                step: StepId(1 << 40),
                outputs: vec![],
            })
            .unwrap_err(),
            s.submit(RequestSpec::new(RequestId(50), vec![], 1))
                .unwrap_err(),
            s.submit(RequestSpec::new(RequestId(51), vec![1; 300], 1))
                .unwrap_err(),
            s.submit(RequestSpec::new(RequestId(52), vec![1], 0))
                .unwrap_err(),
        ];
        for live in [1, 2, 3] {
            if s.request_state(RequestId(live)).is_some() {
                errs.push(
                    s.submit(RequestSpec::new(RequestId(live), vec![1], 1))
                        .unwrap_err(),
                );
            }
        }
        if let Some(op) = plan.ops.first() {
            // A completion of the wrong kind.
            let wrong = if op.kind == OpKind::LoadBack {
                Event::WriteBackDone {
                    op: op.id,
                    success: true,
                }
            } else {
                Event::LoadBackDone {
                    op: op.id,
                    success: true,
                }
            };
            errs.push(s.on_event(wrong).unwrap_err());
            if op.kind == OpKind::L3Query {
                errs.push(
                    s.on_event(Event::L3QueryDone {
                        op: op.id,
                        hit_pages: 10_000,
                    })
                    .unwrap_err(),
                );
            }
        }
        if let Some(step) = plan.forward.step {
            errs.push(
                s.on_event(Event::ForwardDone {
                    step,
                    outputs: vec![],
                })
                .unwrap_err(),
            );
            let mut outs = row_outputs(&plan.forward);
            if let Some(first) = outs.first_mut() {
                first.req = RequestId(9999);
                errs.push(
                    s.on_event(Event::ForwardDone {
                        step,
                        outputs: outs.clone(),
                    })
                    .unwrap_err(),
                );
            }
            if plan.forward.prefill.iter().any(|c| !c.waits_for.is_empty()) {
                let outs = row_outputs(&plan.forward);
                errs.push(
                    s.on_event(Event::ForwardDone {
                        step,
                        outputs: outs,
                    })
                    .unwrap_err(),
                );
            }
        }
        errs
    };
    let mut kinds = std::collections::BTreeSet::new();
    for t in 0..300 {
        let pa = a.next_execution_plan(t);
        let pb = b.next_execution_plan(t);
        assert_eq!(pa, pb, "plans diverged at step {t}");
        for e in bad(&mut b, &pb) {
            kinds.insert(format!("{:?}", std::mem::discriminant(&e)));
        }
        s_check(&a, &b);
        ea.take_plan(pa);
        eb.take_plan(pb);
        // Duplicate completions after the real ones.
        let ids: Vec<OpId> = eb.held.iter().map(|o| o.id).collect();
        while !ea.held.is_empty() {
            ea.complete_op(&mut a, 0);
            eb.complete_op(&mut b, 0);
        }
        for id in ids {
            assert!(matches!(
                b.on_event(Event::LoadBackDone {
                    op: id,
                    success: true
                }),
                Err(SchedulerError::DuplicateCompletion(_))
            ));
        }
        if ea.forward.is_some() {
            let step = ea.forward.as_ref().unwrap().step.unwrap();
            ea.complete_forward(&mut a);
            eb.complete_forward(&mut b);
            assert!(matches!(
                b.on_event(Event::ForwardDone {
                    step,
                    outputs: vec![]
                }),
                Err(SchedulerError::UnknownStep(_))
            ));
        }
        if a.is_idle() {
            break;
        }
    }
    assert!(a.is_idle() && b.is_idle());
    assert!(kinds.len() >= 8, "exercised error kinds: {kinds:?}");
    assert_eq!(a.stats(), b.stats());
    assert_quiescent(&b);
}

/// One (ignored) output per row of a forward, in row order.
fn row_outputs(f: &ForwardBatch) -> Vec<TokenOutput> {
    let reqs = f
        .prefill
        .iter()
        .map(|c| c.req)
        .chain(f.decode.iter().map(|d| d.req));
    reqs.map(|req| TokenOutput {
        req,
        token: 0,
        stop: false,
    })
    .collect()
}

fn s_check(a: &Scheduler, b: &Scheduler) {
    a.check().unwrap();
    b.check().unwrap();
    assert_eq!(a.stats(), b.stats());
}

#[test]
fn config_errors_are_typed() {
    let bad = [
        SchedulerConfig {
            page_size: 0,
            ..cfg()
        },
        SchedulerConfig {
            token_budget: 2,
            ..cfg()
        },
        SchedulerConfig {
            host_enabled: false,
            ..cfg()
        },
        SchedulerConfig {
            host_enabled: false,
            host_pages: 0,
            write_policy: WritePolicy::WriteBack,
            ..cfg()
        },
        SchedulerConfig {
            host_pages: 0,
            ..cfg()
        },
        SchedulerConfig {
            prefetch_stop: PrefetchStopPolicy::Timeout {
                base_ms: 0,
                per_1k_tokens_ms: 0,
            },
            ..cfg()
        },
        SchedulerConfig {
            write_policy: WritePolicy::WriteThroughSelective { hit_threshold: 0 },
            ..cfg()
        },
        SchedulerConfig {
            max_context_tokens: 1 << 30,
            ..cfg()
        },
        SchedulerConfig {
            max_batch_size: 0,
            ..cfg()
        },
    ];
    for c in bad {
        assert!(Scheduler::new(c.clone()).is_err(), "{c:?}");
    }
    assert!(Scheduler::new(cfg()).is_ok());
}

#[test]
fn page_tables_are_sent_as_deltas() {
    let c = cfg();
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut e = Engine::new(&c);
    e.submit(&mut s, 1, prompt(1, 10), 20);
    let mut deltas = 0;
    let mut rows = 0;
    e.run_watching(&mut s, 100, |plan| {
        for d in &plan.forward.decode {
            rows += 1;
            if let Some(delta) = &d.table {
                deltas += 1;
                assert_eq!(delta.pages.len(), 1, "only the new page is sent");
            }
        }
    });
    assert!(rows >= 19);
    assert!(
        deltas <= 5,
        "a delta only when a page is added: {deltas} of {rows}"
    );
}

/// Events turned on and never drained (a router not started yet, a publisher thread that
/// died) held every event since the start: 400 requests over 40 distinct prompts left
/// thousands of events, growing with every request. They stay under `kv_events_max_bytes`;
/// the drain after the overflow answers `Cleared` and exactly the copies held now.
#[test]
fn undrained_kv_events_stay_under_their_cap_and_resync() {
    let c = SchedulerConfig {
        record_kv_events: true,
        kv_events_max_bytes: 4096,
        ..cfg()
    };
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut e = Engine::new(&c);
    let mut peak = 0;
    for r in 0..400u64 {
        e.submit(&mut s, r, prompt(r as u32 % 40, 30), 3);
        e.run_to_idle(&mut s, 100);
        peak = peak.max(s.cache().pending_event_bytes());
    }
    assert!(peak > 0 && peak <= 4096, "peak {peak}");
    let ev = s.drain_kv_events();
    assert_eq!(ev.first(), Some(&KvEvent::Cleared));
    assert_eq!(&ev[1..], &s.resident_kv_events()[..]);
    // recording again: the next request's events only
    e.submit(&mut s, 400, prompt(7, 30), 3);
    e.run_to_idle(&mut s, 100);
    let ev = s.drain_kv_events();
    assert!(!ev.is_empty() && !ev.contains(&KvEvent::Cleared));
    assert!(ev.len() < s.resident_kv_events().len());
}

#[test]
fn kv_events_and_stats_are_reported() {
    let c = SchedulerConfig {
        record_kv_events: true,
        ..cfg()
    };
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut e = Engine::new(&c);
    e.submit(&mut s, 1, prompt(1, 30), 3);
    e.run_to_idle(&mut s, 100);
    e.submit(&mut s, 2, prompt(1, 30), 3);
    e.run_to_idle(&mut s, 100);
    let ev = s.drain_kv_events();
    assert!(ev.iter().any(|x| matches!(x, KvEvent::Stored { .. })));
    assert!(s.drain_kv_events().is_empty());
    let st = s.stats();
    assert_eq!((st.submitted, st.finished), (2, 2));
    assert!(st.computed_tokens > 0 && st.device_hit_tokens > 0);
    assert_eq!(
        st.op(OpKind::WriteBack).issued,
        st.op(OpKind::WriteBack).succeeded
    );
}
