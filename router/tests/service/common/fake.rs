//! Upstreams that misbehave on purpose: a recording [`Fake`] answering as told, a [`Hole`]
//! that accepts and never answers.

use super::*;

/// One request a [`Fake`] upstream received: its request line, its headers as sent (names
/// lower-cased, in order, repeats kept), its body, and the number of its connection.
#[derive(Clone, Debug)]
pub struct Seen {
    pub method: String,
    /// The request target: path and query.
    pub target: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// Which of the upstream's connections carried it (0, 1, ... in accept order).
    pub conn: usize,
    /// Requests on that connection before it.
    pub nth: usize,
}

impl Seen {
    /// Every value of header `name` (lower case), in order.
    pub fn values(&self, name: &str) -> Vec<&str> {
        self.headers
            .iter()
            .filter(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
            .collect()
    }
}

/// How a [`Fake`] answers one request.
#[derive(Clone, Debug)]
pub enum Reply {
    /// A whole answer: status and JSON body, with `content-length`, the connection kept.
    Json(u16, String),
    /// A streamed 200 (`text/event-stream`, chunked): these chunks, then the end.
    Sse(Vec<String>),
    /// Nothing, ever: the request is read and the connection held open (a hung engine).
    Hang,
    /// The connection is closed at once, unanswered (a server that closed it as the
    /// request came).
    Close,
}

/// An HTTP/1.1 upstream on loopback that records every request ([`Seen`]) and answers as
/// `reply` says, keeping connections alive between requests; with `idle_close`, a
/// connection idle that long is closed by the server (uvicorn's `timeout_keep_alive`).
/// Stops when dropped.
pub struct Fake {
    pub addr: SocketAddr,
    pub seen: Arc<Mutex<Vec<Seen>>>,
    /// Connections accepted so far.
    pub accepted: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

type ReplyFn = dyn Fn(&Seen) -> Reply + Send + Sync;

impl Fake {
    pub async fn start(
        reply: impl Fn(&Seen) -> Reply + Send + Sync + 'static,
        idle_close: Option<Duration>,
    ) -> Fake {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = l.local_addr().expect("addr");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let accepted = Arc::new(AtomicUsize::new(0));
        let reply: Arc<ReplyFn> = Arc::new(reply);
        let (sn, ac) = (Arc::clone(&seen), Arc::clone(&accepted));
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            while let Ok((s, _)) = l.accept().await {
                let conn = ac.fetch_add(1, Ordering::SeqCst);
                let (sn, reply) = (Arc::clone(&sn), Arc::clone(&reply));
                // owned by this task: aborting it closes every connection
                conns.spawn(async move { fake_conn(s, conn, &sn, &*reply, idle_close).await });
            }
        });
        Fake {
            addr,
            seen,
            accepted,
            task,
        }
    }

    /// A fake answering every request with one small JSON completion.
    pub async fn ok() -> Fake {
        Fake::start(|_| Reply::Json(200, ok_json()), None).await
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().expect("lock").clone()
    }

    /// Requests received on `path` (the target's path, query left out).
    pub fn count(&self, path: &str) -> usize {
        let s = self.seen.lock().expect("lock");
        s.iter()
            .filter(|r| r.target.split('?').next() == Some(path))
            .count()
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A small completion answer.
pub fn ok_json() -> String {
    r#"{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"hi","finish_reason":"length"}]}"#.into()
}

async fn fake_conn(
    mut s: tokio::net::TcpStream,
    conn: usize,
    seen: &Mutex<Vec<Seen>>,
    reply: &ReplyFn,
    idle_close: Option<Duration>,
) {
    let mut buf: Vec<u8> = Vec::new();
    let mut tmp = [0u8; 8192];
    for nth in 0.. {
        // the head of the next request (the idle timeout runs until its first byte)
        let head_end = loop {
            if let Some(e) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break e;
            }
            let read = s.read(&mut tmp);
            let n = match (idle_close, buf.is_empty()) {
                (Some(t), true) => match tokio::time::timeout(t, read).await {
                    Ok(r) => r,
                    Err(_) => return, // idle: closed by the server
                },
                _ => read.await,
            };
            match n {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&tmp[..n]),
            }
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
        let mut lines = head.split("\r\n");
        let mut first = lines.next().unwrap_or_default().split(' ');
        let (method, target) = (
            first.next().unwrap_or_default().to_string(),
            first.next().unwrap_or_default().to_string(),
        );
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
            .collect();
        let len = headers
            .iter()
            .find(|(k, _)| k == "content-length")
            .and_then(|(_, v)| v.parse::<usize>().ok())
            .unwrap_or(0);
        while buf.len() < head_end + 4 + len {
            match s.read(&mut tmp).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&tmp[..n]),
            }
        }
        let body = buf[head_end + 4..head_end + 4 + len].to_vec();
        buf.drain(..head_end + 4 + len);
        let req = Seen {
            method,
            target,
            headers,
            body,
            conn,
            nth,
        };
        seen.lock().expect("lock").push(req.clone());
        match reply(&req) {
            Reply::Json(status, b) => {
                let r = format!(
                    "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{b}",
                    b.len()
                );
                if s.write_all(r.as_bytes()).await.is_err() {
                    return;
                }
            }
            Reply::Sse(chunks) => {
                let mut r = String::from(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n",
                );
                for c in &chunks {
                    r.push_str(&format!("{:x}\r\n{c}\r\n", c.len()));
                }
                r.push_str("0\r\n\r\n");
                if s.write_all(r.as_bytes()).await.is_err() {
                    return;
                }
            }
            Reply::Hang => {
                // held until the client goes away
                while let Ok(n) = s.read(&mut tmp).await {
                    if n == 0 {
                        return;
                    }
                }
                return;
            }
            Reply::Close => return,
        }
    }
}

/// A loopback listener that accepts every connection and never reads or answers (a hung
/// engine, a half-dead host): connections are held until it is dropped.
pub struct Hole {
    pub addr: SocketAddr,
    pub accepted: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Hole {
    pub async fn start() -> Hole {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = l.local_addr().expect("addr");
        let accepted = Arc::new(AtomicUsize::new(0));
        let ac = Arc::clone(&accepted);
        let task = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = l.accept().await {
                ac.fetch_add(1, Ordering::SeqCst);
                held.push(s);
            }
        });
        Hole {
            addr,
            accepted,
            task,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for Hole {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// An instance whose `/tokenize` counts 5 tokens for anything and that answers every other
/// request with `reply`.
pub async fn tokenizing(reply: Reply) -> Fake {
    Fake::start(
        move |s| {
            if s.target.starts_with("/tokenize") {
                Reply::Json(200, r#"{"tokens":[1,2,3,4,5],"count":5}"#.into())
            } else {
                reply.clone()
            }
        },
        None,
    )
    .await
}

/// An instance that answers everything: SSE for a streamed request, JSON otherwise, its
/// `/tokenize` 5 tokens and its `/v1/models` one model.
pub async fn healthy() -> Fake {
    Fake::start(
        |s| {
            let streamed = serde_json::from_slice::<serde_json::Value>(&s.body)
                .ok()
                .and_then(|v| v.get("stream").and_then(serde_json::Value::as_bool))
                == Some(true);
            if s.target.starts_with("/v1/models") {
                Reply::Json(200, r#"{"object":"list","data":[{"id":"m"}]}"#.into())
            } else if s.target.starts_with("/tokenize") {
                Reply::Json(200, r#"{"tokens":[1,2,3,4,5],"count":5}"#.into())
            } else if streamed {
                Reply::Sse(vec![
                    "data: {\"choices\":[{\"text\":\"a\"}]}\n\n".into(),
                    "data: [DONE]\n\n".into(),
                ])
            } else {
                Reply::Json(200, ok_json())
            }
        },
        None,
    )
    .await
}
