//! The split deployment under test: one `--role master` with a state dir (or several on
//! etcd, [`crate::ha`]) and `n` store nodes with SSD dirs (or DRAM only), real `kvtier-l3`
//! processes on 127.0.0.1, each of which can be SIGKILLed and restarted with the same
//! identity (the master on the same address and state dir; a node with the same
//! `--node-id` and `--ssd-dir`), and a node also SIGSTOPped and SIGCONTed.

use std::path::{Path, PathBuf};

use kvtier_l3::ha::Locator;

use crate::Mode;
use crate::ha::{HaMasters, Proc, Single, spawn};

/// Starts a node and waits for its `LISTENING addr` line.
fn start(bin: &Path, args: &[String], name: &str) -> Result<Proc, String> {
    let mut p = spawn(bin, args, true, name)?;
    let out = p.child.stdout.take().ok_or("no stdout")?;
    kvtier_l3::cli::read_listening(out).map_err(|e| format!("{e} from {args:?}"))?;
    Ok(p)
}

/// How a node writes SSD copies (`None`: it has no SSD tier).
fn node_offload(mode: Mode, i: usize) -> Option<&'static str> {
    match mode {
        Mode::WriteThrough => Some("write-through"),
        Mode::OnEvict => Some("on-evict"),
        Mode::Mixed if i.is_multiple_of(2) => Some("write-through"),
        Mode::Mixed => Some("on-evict"),
        Mode::DramOnly => None,
    }
}

/// A running store node.
struct Node {
    proc: Proc,
    /// SIGSTOPped (and not yet SIGCONTed).
    paused: bool,
}

/// The masters: one with a state dir, or several on etcd.
pub enum Masters {
    Single(Single),
    Ha(HaMasters),
}

/// The deployment: the single master's address never changes across its restarts; with
/// etcd, nodes and clients follow the leader.
pub struct Cluster {
    bin: PathBuf,
    dir: PathBuf,
    mode: Mode,
    segment_bytes: u64,
    pub masters: Masters,
    nodes: Vec<Option<Node>>,
}

impl Cluster {
    /// Starts the master (`ha_masters` 0) or that many masters on etcd, and `nodes` store
    /// nodes under `dir`.
    pub fn start(
        bin: &Path,
        dir: &Path,
        mode: Mode,
        nodes: usize,
        segment_bytes: u64,
        ttl_ms: u64,
        ha: Option<(usize, u64)>,
    ) -> Result<Self, String> {
        std::fs::create_dir_all(dir.join("master")).map_err(|e| e.to_string())?;
        let masters = match ha {
            Some((n, leader_ttl_s)) => Masters::Ha(HaMasters::start(bin, n, leader_ttl_s, ttl_ms)?),
            None => {
                let mut s = Single {
                    proc: None,
                    addr: "127.0.0.1:0".parse().map_err(|e| format!("{e}"))?,
                    state_dir: dir.join("master"),
                    client_ttl_ms: ttl_ms,
                };
                s.start(bin)?;
                Masters::Single(s)
            }
        };
        let mut c = Cluster {
            bin: bin.to_path_buf(),
            dir: dir.to_path_buf(),
            mode,
            segment_bytes,
            masters,
            nodes: (0..nodes).map(|_| None).collect(),
        };
        for i in 0..nodes {
            c.start_node(i)?;
        }
        Ok(c)
    }

    /// What nodes are given as `--master`.
    fn master_spec(&self) -> String {
        match &self.masters {
            Masters::Single(s) => s.addr.to_string(),
            Masters::Ha(h) => h.locator(),
        }
    }

    /// How clients find the master.
    pub fn locator(&self) -> Result<Locator, String> {
        Locator::parse(&self.master_spec()).map_err(|e| e.to_string())
    }

    fn start_node(&mut self, i: usize) -> Result<(), String> {
        let mut args: Vec<String> = [
            "--role",
            "node",
            "--listen",
            "127.0.0.1:0",
            "--master",
            &self.master_spec(),
            "--node-id",
            &(i + 1).to_string(),
            "--ping-ms",
            "100",
            "--segment-bytes",
            &self.segment_bytes.to_string(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if let Some(offload) = node_offload(self.mode, i) {
            let ssd = self.dir.join(format!("node{}", i + 1));
            args.extend([
                "--ssd-dir".to_string(),
                ssd.display().to_string(),
                "--offload".to_string(),
                offload.to_string(),
            ]);
        }
        if let Masters::Ha(_) = self.masters {
            // A paused leader costs a node this long before it looks for the next one.
            args.extend(["--master-timeout-ms".to_string(), "1000".to_string()]);
        }
        let proc = start(&self.bin, &args, &format!("node-{}", i + 1))?;
        self.nodes[i] = Some(Node {
            proc,
            paused: false,
        });
        Ok(())
    }

    pub fn nodes(&self) -> usize {
        self.nodes.len()
    }

    /// Running and not paused.
    pub fn node_up(&self, i: usize) -> bool {
        self.nodes[i].as_ref().is_some_and(|n| !n.paused)
    }

    /// SIGKILL (the drop of [`Proc`]; a paused node is resumed first).
    pub fn kill_node(&mut self, i: usize) {
        self.nodes[i] = None;
    }

    /// SIGSTOPs node `i` if it is running.
    pub fn pause_node(&mut self, i: usize) {
        if let Some(n) = &mut self.nodes[i] {
            n.proc.signal(libc::SIGSTOP);
            n.paused = true;
        }
    }

    /// SIGCONTs node `i` if it is paused.
    pub fn resume_node(&mut self, i: usize) {
        if let Some(n) = &mut self.nodes[i]
            && n.paused
        {
            n.proc.signal(libc::SIGCONT);
            n.paused = false;
        }
    }

    /// Restarts node `i` if it is down (same id, same SSD dir).
    pub fn revive_node(&mut self, i: usize) -> Result<(), String> {
        if self.nodes[i].is_none() {
            self.start_node(i)?;
        }
        Ok(())
    }

    /// Restarts the single master if it is down (same address, same state dir). The
    /// address may still be held for a moment after the kill: retried.
    pub fn revive_single(&mut self) -> Result<(), String> {
        let Masters::Single(s) = &mut self.masters else {
            return Ok(());
        };
        let mut last = String::new();
        for _ in 0..50 {
            if s.proc.is_some() {
                return Ok(());
            }
            match s.start(&self.bin) {
                Ok(()) => return Ok(()),
                Err(e) => last = e,
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        Err(format!("master did not restart: {last}"))
    }

    /// Brings HA master `i` back (SIGCONT, or a new process on its address).
    pub fn revive_ha(&mut self, i: usize) -> Result<(), String> {
        match &mut self.masters {
            Masters::Ha(h) => h.revive(&self.bin, i),
            Masters::Single(_) => Ok(()),
        }
    }

    /// Every master down (SIGKILL).
    pub fn kill_masters(&mut self) {
        match &mut self.masters {
            Masters::Single(s) => s.proc = None,
            Masters::Ha(h) => h.kill_all(),
        }
    }

    /// Every paused node and master resumed (what is dead stays dead).
    pub fn resume_all(&mut self) {
        for i in 0..self.nodes.len() {
            self.resume_node(i);
        }
        if let Masters::Ha(h) = &mut self.masters {
            h.resume_all();
        }
    }

    /// Everything up again (and resumed).
    pub fn revive_all(&mut self) -> Result<(), String> {
        match &mut self.masters {
            Masters::Single(_) => self.revive_single()?,
            Masters::Ha(h) => h.revive_all(&self.bin)?,
        }
        for i in 0..self.nodes.len() {
            self.resume_node(i);
            let mut tries = 0;
            while let Err(e) = self.revive_node(i) {
                tries += 1;
                if tries == 25 {
                    return Err(format!("node {} did not restart: {e}", i + 1));
                }
                std::thread::sleep(std::time::Duration::from_millis(200));
            }
        }
        Ok(())
    }
}
