//! Binding a socket to a configured address: every refusal a typed error.
//!
//! Why not `zmq::Socket::bind`: it turns the errno of a failed bind into `zmq::Error` with
//! `Error::from_raw`, which panics on an errno the crate does not list. bind(2) of an ipc
//! address under a regular file fails with ENOTDIR, one it does not list: the publisher
//! panicked (a PanicException in Python, a dead publishing thread in a `kvtier-l3` leader
//! retrying its bind) where a wrong address is the caller's error. And a TCP port that is
//! not one is refused here (ZMQ binds it modulo 65,536), as is an ipc address another socket
//! listens on (ZMQ takes it over).

use std::ffi::{CStr, CString};

use crate::publisher::PublishError;

/// The errors `zmq::Error::from_raw` knows, so only those are converted.
const KNOWN: [zmq::Error; 28] = [
    zmq::Error::EACCES,
    zmq::Error::EADDRINUSE,
    zmq::Error::EAGAIN,
    zmq::Error::EBUSY,
    zmq::Error::ECONNREFUSED,
    zmq::Error::EFAULT,
    zmq::Error::EHOSTUNREACH,
    zmq::Error::EINPROGRESS,
    zmq::Error::EINVAL,
    zmq::Error::EMFILE,
    zmq::Error::EMSGSIZE,
    zmq::Error::ENAMETOOLONG,
    zmq::Error::ENODEV,
    zmq::Error::ENOENT,
    zmq::Error::ENOMEM,
    zmq::Error::ENOTCONN,
    zmq::Error::ENOTSOCK,
    zmq::Error::EPROTO,
    zmq::Error::EPROTONOSUPPORT,
    zmq::Error::ENOTSUP,
    zmq::Error::ENOBUFS,
    zmq::Error::ENETDOWN,
    zmq::Error::EADDRNOTAVAIL,
    zmq::Error::EINTR,
    zmq::Error::EFSM,
    zmq::Error::ENOCOMPATPROTO,
    zmq::Error::ETERM,
    zmq::Error::EMTHREAD,
];

/// Binds `socket` to `endpoint`; `what` names the socket in the error.
pub(crate) fn bind(
    socket: &mut zmq::Socket,
    endpoint: &str,
    what: &str,
) -> Result<(), PublishError> {
    let what = format!("bind {what} {endpoint}");
    // ZMQ reads a TCP port with strtoul and keeps its low 16 bits: `:99999` bound port
    // 34463 and `:-1` port 65535, with no error
    if let Some(rest) = endpoint.strip_prefix("tcp://") {
        let port = rest.rsplit_once(':').map_or("", |(_, p)| p);
        let digits = !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit());
        if port != "*" && !(digits && port.parse::<u16>().is_ok()) {
            return Err(PublishError::Config(format!(
                "{what}: the port must be * or a number from 0 to 65535, not {port:?}"
            )));
        }
    }
    // ZMQ unlinks an ipc address's socket file and binds anew, even while another socket
    // listens there: the other (another engine's publisher) goes on unheard by every
    // subscriber that connects after. Someone answering there is EADDRINUSE, as TCP's; a
    // file nobody answers on (a crashed publisher's) is ZMQ's to replace.
    if let Some(path) = endpoint.strip_prefix("ipc://")
        && path != "*"
        && !path.starts_with('@')
        && std::os::unix::net::UnixStream::connect(path).is_ok()
    {
        return Err(PublishError::Zmq {
            what,
            source: zmq::Error::EADDRINUSE,
        });
    }
    let c = CString::new(endpoint)
        .map_err(|_| PublishError::Config(format!("{what}: the address contains a NUL byte")))?;
    // SAFETY: a live socket of this thread and a NUL-terminated address.
    if unsafe { zmq_sys::zmq_bind(socket.as_mut_ptr(), c.as_ptr()) } == 0 {
        return Ok(());
    }
    // SAFETY: reads the calling thread's errno as ZMQ left it.
    let errno = unsafe { zmq_sys::zmq_errno() };
    if let Some(source) = KNOWN.into_iter().find(|e| e.to_raw() == errno) {
        return Err(PublishError::Zmq { what, source });
    }
    // SAFETY: zmq_strerror returns a static NUL-terminated string for any errno.
    let reason = unsafe { CStr::from_ptr(zmq_sys::zmq_strerror(errno)) };
    Err(PublishError::Config(format!(
        "{what}: {} (errno {errno})",
        reason.to_string_lossy()
    )))
}
