//! A publisher that speaks as vLLM 0.32's `ZmqEventPublisher` does.

use super::*;

/// A publisher that speaks as vLLM 0.32's `ZmqEventPublisher` does: PUB frames
/// `[topic, seq, payload]`; the replay ROUTER reads the start number unsigned (so -2 asks for
/// nothing) and answers `[id, "", topic, seq, payload]` per kept batch, then
/// `[id, "", "", -1, ""]`. It serves the batches given once [`VllmLike::publish`] is called,
/// sending live only those `send_live` allows.
pub struct VllmLike {
    pub events: String,
    pub replay: String,
    go: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl VllmLike {
    pub fn start(
        batches: Vec<(u64, Vec<u8>)>,
        send_live: impl Fn(u64) -> bool + Send + 'static,
    ) -> Self {
        let ctx = zmq::Context::new();
        let pub_ = ctx.socket(zmq::PUB).expect("pub");
        pub_.bind("tcp://127.0.0.1:*").expect("bind");
        let router = ctx.socket(zmq::ROUTER).expect("router");
        router.bind("tcp://127.0.0.1:*").expect("bind");
        let ep = |s: &zmq::Socket| s.get_last_endpoint().expect("ep").expect("utf-8");
        let (events, replay) = (ep(&pub_), ep(&router));
        let stop = Arc::new(AtomicBool::new(false));
        let go = Arc::new(AtomicBool::new(false));
        let (s, g) = (Arc::clone(&stop), Arc::clone(&go));
        let thread = std::thread::spawn(move || {
            let _ctx = ctx;
            let mut sent = false;
            while !s.load(Ordering::Relaxed) {
                if !sent && g.load(Ordering::Relaxed) {
                    for (seq, p) in batches.iter().filter(|b| send_live(b.0)) {
                        let _ = pub_.send_multipart([&b""[..], &seq.to_be_bytes()[..], &p[..]], 0);
                    }
                    sent = true;
                }
                if router.poll(zmq::POLLIN, 20).unwrap_or(0) == 0 {
                    continue;
                }
                let Ok(f) = router.recv_multipart(0) else {
                    continue;
                };
                let [id, _, start] = f.as_slice() else {
                    continue;
                };
                let mut b = [0u8; 8];
                b.copy_from_slice(&start[..8.min(start.len())]);
                let start = u64::from_be_bytes(b);
                if sent {
                    for (seq, p) in batches.iter().filter(|b| b.0 >= start) {
                        let _ = router
                            .send_multipart([&id[..], b"", b"", &seq.to_be_bytes()[..], &p[..]], 0);
                    }
                }
                let _ =
                    router.send_multipart([&id[..], b"", b"", &(-1i64).to_be_bytes()[..], b""], 0);
            }
        });
        VllmLike {
            events,
            replay,
            go,
            stop,
            thread: Some(thread),
        }
    }

    /// Publishes the batches (live and in the replay buffer).
    pub fn publish(&self) {
        self.go.store(true, Ordering::Relaxed);
    }

    pub fn spec(&self) -> EndpointSpec {
        EndpointSpec {
            events: Some(self.events.clone()),
            replay: Some(self.replay.clone()),
            url: None,
            topic: None,
        }
    }
}

impl Drop for VllmLike {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
