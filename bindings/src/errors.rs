//! Typed Rust errors → Python exceptions, one class per kind.
//!
//! Why one class per kind: an engine catches `kvtier.UnknownOpError` (a late completion it can
//! drop) differently from `kvtier.IllegalEventError` (its own bug); parsing messages would be
//! fragile. The hierarchy is
//!
//! ```text
//! KvtierError
//! ├── ConfigError (also a ValueError)
//! ├── AgreementError (also a ValueError): `RankAgreement` refused a call
//! ├── SchedulerError ── UnknownRequestError, DuplicateRequestError, InvalidRequestError,
//! │                     UnknownOpError, DuplicateCompletionError, WrongCompletionKindError,
//! │                     BadCompletionError, UnknownStepError, NotInStepError,
//! │                     RowCountMismatchError, CompletionOutOfOrderError, IllegalEventError,
//! │                     CacheError, OffloadManagerError, LossNeedsAgreementError,
//!                     FoundNeedsAgreementError
//! ├── EventsError: the KV event publisher could not bind, encode or send
//! └── L3Error ── ObjectNotFoundError, ObjectAlreadyExistsError, ... (each with a class
//!                attribute `code`: Mooncake's integer error code, e.g. -704)
//! ```
//!
//! Bad *arguments* (wrong types, negative sizes, out-of-range integers) raise Python's own
//! `TypeError` / `ValueError` / `OverflowError`, as any Python API would.

use pyo3::prelude::*;
use pyo3::types::PyType;

use kvtier_l3::{ErrorCode, L3Error};
use kvtier_scheduler::{ConfigError, SchedulerError};

/// The base classes (own module: their Python names equal the Rust error types' names).
pub mod base {
    use pyo3::exceptions::{PyException, PyValueError};

    pyo3::create_exception!(
        kvtier,
        KvtierError,
        PyException,
        "Base class of every kvtier error."
    );
    pyo3::create_exception!(
        kvtier,
        ConfigError,
        PyValueError,
        "An invalid SchedulerConfig (names the field)."
    );
    pyo3::create_exception!(
        kvtier,
        AgreementError,
        PyValueError,
        "RankAgreement refused a call; nothing changed: a forward result, an op recorded twice, a completion of another kind than its op's or a count above what the op asked for, a checked push for an op not in flight, a reduced vector of the wrong length or that is not the minimum over ranks, loss or found words that are malformed, leave out this rank's own or come from another number of ranks than tp_ranks."
    );
    pyo3::create_exception!(
        kvtier,
        SchedulerError,
        KvtierError,
        "The scheduler rejected a call; nothing changed."
    );
    pyo3::create_exception!(
        kvtier,
        EventsError,
        KvtierError,
        "The KV event publisher could not bind its sockets, encode or hand over a batch."
    );
    pyo3::create_exception!(
        kvtier,
        L3Error,
        KvtierError,
        "An L3 store operation failed; `code` is Mooncake's integer error code."
    );
}

use base::{
    ConfigError as PyConfigError, KvtierError, L3Error as PyL3Error,
    SchedulerError as PySchedulerError,
};

macro_rules! sched_errors {
    ($($name:ident: $doc:literal),* $(,)?) => {
        $(pyo3::create_exception!(kvtier, $name, PySchedulerError, $doc);)*
        fn add_sched_errors(m: &Bound<'_, PyModule>) -> PyResult<()> {
            let py = m.py();
            $(m.add(stringify!($name), py.get_type::<$name>())?;)*
            Ok(())
        }
    };
}

sched_errors! {
    UnknownRequestError: "No live request has this id.",
    DuplicateRequestError: "A live request already has this id.",
    InvalidRequestError: "The request is invalid (empty prompt, max_new_tokens 0, too long).",
    UnknownOpError: "No op has this id.",
    DuplicateCompletionError: "The op already completed (duplicated or late completion).",
    WrongCompletionKindError: "The completion's kind differs from the op's kind.",
    BadCompletionError: "The completion's values are impossible for the op.",
    UnknownStepError: "No forward step in flight has this id.",
    NotInStepError: "A forward result names a request that is not in the step.",
    RowCountMismatchError: "The forward results list a different number of rows than the step.",
    CompletionOutOfOrderError: "A forward completed before an op it waits for.",
    IllegalEventError: "The event is illegal in the request's current state.",
    CacheError: "The prefix cache rejected the operation.",
    OffloadManagerError: "OffloadManager refused a call (unknown job, a range off the chain, pages not on host) or failed its consistency check; nothing changed.",
    FoundNeedsAgreementError: "A direct L3 find (OffloadManager.l3_found) on a manager of several tensor-parallel ranks (tp_ranks > 1): record each rank's finds with RankAgreement.found_pages and mark the pages every rank found with RankAgreement.agree_found (or OffloadManager.agree_found in one process); nothing changed.",
    LossNeedsAgreementError: "A direct L3 loss report (Scheduler.l3_lost / l3_lost_all, OffloadManager.l3_lost / l3_lost_all) on one rank of several (tp_ranks > 1): record it with RankAgreement.lost / lost_pages / lost_all and apply it with RankAgreement.agree_losses; nothing changed.",
}

macro_rules! l3_errors {
    ($($name:ident = $code:expr, $doc:literal;)*) => {
        $(pyo3::create_exception!(kvtier, $name, PyL3Error, $doc);)*
        fn add_l3_errors(m: &Bound<'_, PyModule>) -> PyResult<()> {
            let py = m.py();
            $(
                let t = py.get_type::<$name>();
                t.setattr("code", ($code as ErrorCode).as_i32())?;
                m.add(stringify!($name), t)?;
            )*
            Ok(())
        }
    };
}

l3_errors! {
    ObjectNotFoundError = ErrorCode::ObjectNotFound, "-704: the key does not exist.";
    ObjectAlreadyExistsError = ErrorCode::ObjectAlreadyExists, "-705: the key exists or a put of it is in progress.";
    ObjectHasLeaseError = ErrorCode::ObjectHasLease, "-706: the object is leased; pass force=True.";
    LeaseExpiredError = ErrorCode::LeaseExpired, "-707: a query result's lease expired; query again.";
    ReplicaNotReadyError = ErrorCode::ReplicaIsNotReady, "-703: the put has not ended yet.";
    NoAvailableHandleError = ErrorCode::NoAvailableHandle, "-200: no space left, even after eviction.";
    InvalidParamsError = ErrorCode::InvalidParams, "-600: a parameter is invalid.";
    InvalidKeyError = ErrorCode::InvalidKey, "-400: the key is empty, too long or contains NUL.";
    IllegalClientError = ErrorCode::IllegalClient, "-601: wrong token or not the owner of a pending put.";
    BufferOverflowError = ErrorCode::BufferOverflow, "-10: the buffer is smaller than the object.";
    SegmentNotFoundError = ErrorCode::SegmentNotFound, "-101: no such segment.";
    SegmentAlreadyExistsError = ErrorCode::SegmentAlreadyExists, "-102: segment already mounted.";
    ClientNotFoundError = ErrorCode::ClientNotFound, "-103: client unknown to the master.";
    FileWriteFailError = ErrorCode::FileWriteFail, "-1103: SSD write failed.";
    FileReadFailError = ErrorCode::FileReadFail, "-1102: SSD read failed.";
    FileOpenFailError = ErrorCode::FileOpenFail, "-1101: opening SSD storage failed.";
    UnableOffloadError = ErrorCode::UnableOffload, "-1300: the SSD tier is not enabled.";
    UnableOffloadingError = ErrorCode::UnableOffloading, "-1301: the offload queue is full.";
    RpcFailError = ErrorCode::RpcFail, "-900: transport failure talking to a server.";
    UnavailableError = ErrorCode::UnavailableInCurrentStatus, "-1010: the server is shutting down or not ready.";
    L3InternalError = ErrorCode::InternalError, "-1: an internal error of the store.";
    ReplicaIsGoneError = ErrorCode::ReplicaIsGone, "-712: the object was dropped (evicted, removed) before its SSD copy was registered.";
}

// -1011 is a kind of "unavailable": `except UnavailableError` still catches it, and its own
// `code` says which (before, it was raised as UnavailableError with code -1010).
pyo3::create_exception!(
    kvtier,
    UnavailableInModeError,
    UnavailableError,
    "-1011: this deployment mode (or store configuration) cannot do the call."
);

// A put whose phases straddle a master failover (or an answer from a deposed master): also
// a kind of "unavailable" (`except UnavailableError` still catches it, with the same code
// -1010), but one a caller handles differently: put the object again, do not just retry.
pyo3::create_exception!(
    kvtier,
    EpochFencedError,
    UnavailableError,
    "-1010: the call straddled a master failover (an older leader epoch's put or answer); put it again."
);

// A peer (server, client or master) of another kvtier-l3 wire protocol version, refused
// at hello: its own class, as an operator fixes it by upgrading, never by retrying.
pyo3::create_exception!(
    kvtier,
    ProtocolMismatchError,
    PyL3Error,
    "-300: the server (or this client) speaks another kvtier-l3 wire protocol version; the message names both. Upgrade one side so both share the version."
);

/// Registers every exception class on the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("KvtierError", py.get_type::<KvtierError>())?;
    m.add("ConfigError", py.get_type::<PyConfigError>())?;
    m.add("AgreementError", py.get_type::<base::AgreementError>())?;
    m.add("SchedulerError", py.get_type::<PySchedulerError>())?;
    m.add("EventsError", py.get_type::<base::EventsError>())?;
    let l3: Bound<'_, PyType> = py.get_type::<PyL3Error>();
    l3.setattr("code", ErrorCode::InternalError.as_i32())?;
    m.add("L3Error", l3)?;
    add_sched_errors(m)?;
    add_l3_errors(m)?;
    let t = py.get_type::<UnavailableInModeError>();
    t.setattr("code", ErrorCode::UnavailableInCurrentMode.as_i32())?;
    m.add("UnavailableInModeError", t)?;
    let t = py.get_type::<EpochFencedError>();
    t.setattr("code", ErrorCode::UnavailableInCurrentStatus.as_i32())?;
    m.add("EpochFencedError", t)?;
    let t = py.get_type::<ProtocolMismatchError>();
    t.setattr("code", ErrorCode::InvalidVersion.as_i32())?;
    m.add("ProtocolMismatchError", t)?;
    Ok(())
}

/// A configuration error as a Python `ConfigError`.
pub fn config_err(e: ConfigError) -> PyErr {
    PyConfigError::new_err(e.to_string())
}

/// A configuration message (a bad setting string) as a Python `ConfigError`.
pub fn config_msg(msg: String) -> PyErr {
    PyConfigError::new_err(msg)
}

/// A scheduler error as the Python class of its kind.
pub fn sched_err(e: SchedulerError) -> PyErr {
    let msg = e.to_string();
    match e {
        SchedulerError::UnknownRequest(_) => UnknownRequestError::new_err(msg),
        SchedulerError::DuplicateRequest(_) => DuplicateRequestError::new_err(msg),
        SchedulerError::EmptyPrompt
        | SchedulerError::ZeroMaxNewTokens
        | SchedulerError::TooLong { .. }
        | SchedulerError::BadExtraKey { .. }
        | SchedulerError::ExceedsTenantQuota { .. } => InvalidRequestError::new_err(msg),
        SchedulerError::UnknownOp(_) => UnknownOpError::new_err(msg),
        SchedulerError::DuplicateCompletion(_) => DuplicateCompletionError::new_err(msg),
        SchedulerError::WrongCompletionKind { .. } => WrongCompletionKindError::new_err(msg),
        SchedulerError::BadCompletion { .. } | SchedulerError::NotAnOpCompletion(_) => {
            BadCompletionError::new_err(msg)
        }
        SchedulerError::UnknownStep(_) => UnknownStepError::new_err(msg),
        SchedulerError::NotInStep { .. } => NotInStepError::new_err(msg),
        SchedulerError::RowCountMismatch { .. } => RowCountMismatchError::new_err(msg),
        SchedulerError::CompletionOutOfOrder { .. } => CompletionOutOfOrderError::new_err(msg),
        SchedulerError::IllegalEvent { .. } => IllegalEventError::new_err(msg),
        SchedulerError::Cache(_) => CacheError::new_err(msg),
        SchedulerError::LossNeedsAgreement { .. } => LossNeedsAgreementError::new_err(msg),
    }
}

/// An L3 error as the Python class of its kind.
pub fn l3_err(e: L3Error) -> PyErr {
    let msg = e.to_string();
    match e {
        L3Error::ObjectNotFound => ObjectNotFoundError::new_err(msg),
        L3Error::ObjectAlreadyExists => ObjectAlreadyExistsError::new_err(msg),
        L3Error::ObjectHasLease => ObjectHasLeaseError::new_err(msg),
        L3Error::LeaseExpired => LeaseExpiredError::new_err(msg),
        L3Error::ReplicaIsNotReady => ReplicaNotReadyError::new_err(msg),
        L3Error::NoAvailableHandle { .. } => NoAvailableHandleError::new_err(msg),
        L3Error::InvalidParams(_) => InvalidParamsError::new_err(msg),
        L3Error::InvalidKey(_) => InvalidKeyError::new_err(msg),
        L3Error::IllegalClient(_) => IllegalClientError::new_err(msg),
        L3Error::BufferOverflow { .. } => BufferOverflowError::new_err(msg),
        L3Error::SegmentNotFound => SegmentNotFoundError::new_err(msg),
        L3Error::SegmentAlreadyExists => SegmentAlreadyExistsError::new_err(msg),
        L3Error::ClientNotFound => ClientNotFoundError::new_err(msg),
        L3Error::FileWriteFail(_) => FileWriteFailError::new_err(msg),
        L3Error::FileReadFail(_) => FileReadFailError::new_err(msg),
        L3Error::FileOpenFail(_) => FileOpenFailError::new_err(msg),
        L3Error::UnableOffload => UnableOffloadError::new_err(msg),
        L3Error::UnableOffloading => UnableOffloadingError::new_err(msg),
        L3Error::RpcFail(_) => RpcFailError::new_err(msg),
        L3Error::Unavailable(_) | L3Error::NotLeader(_) => UnavailableError::new_err(msg),
        L3Error::EpochFenced(_) => EpochFencedError::new_err(msg),
        L3Error::Internal(_) => L3InternalError::new_err(msg),
        L3Error::UnavailableInMode(_) => UnavailableInModeError::new_err(msg),
        L3Error::ReplicaIsGone(_) => ReplicaIsGoneError::new_err(msg),
        L3Error::ProtocolMismatch { .. } => ProtocolMismatchError::new_err(msg),
    }
}
