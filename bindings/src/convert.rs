//! Argument conversion: integer arrays from numpy or sequences, byte buffers from the buffer
//! protocol.
//!
//! Why by hand: an engine passes numpy arrays of whatever integer dtype it has (int64 token
//! ids from a tokenizer, uint32 from a previous plan), or plain lists. A matching numpy array
//! is read in place; anything else is converted once with range checks, so a negative id or a
//! token ≥ 2³² is a `ValueError`/`OverflowError`, never a silent wrap. Byte buffers must be
//! C-contiguous; a read-only one is refused where kvtier would write.

use numpy::{PyArrayDescrMethods, PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::exceptions::{PyOverflowError, PyTypeError, PyValueError};
use pyo3::prelude::*;

/// Most elements accepted in one integer argument (a guard against absurd inputs: 2³¹).
pub const MAX_ELEMS: usize = 1 << 31;

fn range_err(what: &str, v: impl std::fmt::Display, max: u64) -> PyErr {
    PyOverflowError::new_err(format!("{what}: {v} is outside 0..={max}"))
}

/// `v` as a `T` if it lies in `0..=max` (`max` fits `T`), else an `OverflowError`.
fn in_range<T: TryFrom<i128>>(v: i128, what: &str, max: u64) -> PyResult<T> {
    if v < 0 || v > max as i128 {
        return Err(range_err(what, v, max));
    }
    T::try_from(v).map_err(|_| range_err(what, v, max))
}

/// Reads a 1-D integer array-like into `Vec<T>` (copying only when the dtype differs).
macro_rules! int_vec {
    ($fname:ident, $t:ty) => {
        pub fn $fname(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<$t>> {
            if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, $t>>() {
                return Ok(a.as_array().iter().copied().collect());
            }
            let max = <$t>::MAX as u64;
            if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, i64>>() {
                return a
                    .as_array()
                    .iter()
                    .map(|&v| in_range(v.into(), what, max))
                    .collect();
            }
            if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, u64>>() {
                return a
                    .as_array()
                    .iter()
                    .map(|&v| in_range(v.into(), what, max))
                    .collect();
            }
            if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, i32>>() {
                return a
                    .as_array()
                    .iter()
                    .map(|&v| in_range(v.into(), what, max))
                    .collect();
            }
            if obj.is_instance_of::<pyo3::types::PyString>()
                || obj.is_instance_of::<pyo3::types::PyBytes>()
            {
                return Err(PyTypeError::new_err(format!(
                    "{what}: expected a sequence of integers, got str/bytes"
                )));
            }
            let n = obj.len().map_err(|_| {
                PyTypeError::new_err(format!(
                    "{what}: expected a 1-D integer array or a sequence of integers, got {}",
                    obj.get_type()
                        .name()
                        .map(|n| n.to_string())
                        .unwrap_or_default()
                ))
            })?;
            if n > MAX_ELEMS {
                return Err(PyValueError::new_err(format!(
                    "{what}: {n} elements is too many"
                )));
            }
            let mut out = Vec::with_capacity(n);
            for item in obj.try_iter()? {
                let item = item?;
                let v: i128 = item.extract().map_err(|_| {
                    PyTypeError::new_err(format!("{what}: elements must be integers"))
                })?;
                out.push(in_range(v, what, max)?);
            }
            Ok(out)
        }
    };
}

int_vec!(u32_vec, u32);
int_vec!(u64_vec, u64);

/// Reads a 1-D bool array-like (numpy bool array or sequence of truthy values).
pub fn bool_vec(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<bool>> {
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, bool>>() {
        return Ok(a.as_array().iter().copied().collect());
    }
    let n = obj
        .len()
        .map_err(|_| PyTypeError::new_err(format!("{what}: expected a sequence of bools")))?;
    if n > MAX_ELEMS {
        return Err(PyValueError::new_err(format!(
            "{what}: {n} elements is too many"
        )));
    }
    let mut out = Vec::with_capacity(n);
    for item in obj.try_iter()? {
        out.push(item?.is_truthy()?);
    }
    Ok(out)
}

/// A list of `str` (keys), refusing a bare `str` (which is a sequence of characters).
pub fn str_list(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<String>> {
    if obj.is_instance_of::<pyo3::types::PyString>() {
        return Err(PyTypeError::new_err(format!(
            "{what}: expected a list of str, got str"
        )));
    }
    obj.extract::<Vec<String>>()
        .map_err(|_| PyTypeError::new_err(format!("{what}: expected a list of str")))
}

/// A C-contiguous byte view of a Python buffer (bytes, bytearray, memoryview, numpy array,
/// anything `numpy.frombuffer` accepts). Holding it keeps the memory alive and, for
/// exporters like `bytearray`, unresizable.
///
/// How without the buffer protocol: the abi3 (Python ≥ 3.9) limited API lacks
/// `PyObject_GetBuffer` before 3.11, so `bytes` is read directly and everything else goes
/// through a numpy array (the object itself, or `numpy.asarray(memoryview(obj))`, which
/// keeps the exporter's format and strides), whose data pointer, size, dtype and flags
/// numpy's C API gives. Refused: arrays holding Python objects (`TypeError`: their bytes are
/// pointers), non-contiguous ones (`ValueError`), read-only ones where kvtier writes
/// (`TypeError`).
pub struct ByteBuf {
    _owner: Py<PyAny>,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the memory stays valid while `_owner` (bytes or an ndarray holding its base) is
// referenced; it is only accessed through the slices below, which borrow `self`.
unsafe impl Send for ByteBuf {}
unsafe impl Sync for ByteBuf {}

impl ByteBuf {
    /// Gets a buffer; `writable` refuses read-only exporters (e.g. `bytes`).
    pub fn get(obj: &Bound<'_, PyAny>, writable: bool, what: &str) -> PyResult<ByteBuf> {
        let type_err = || {
            PyTypeError::new_err(format!(
                "{what}: expected a bytes-like object, got {}",
                obj.get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_default()
            ))
        };
        if let Ok(b) = obj.cast::<pyo3::types::PyBytes>() {
            if writable {
                return Err(PyTypeError::new_err(format!(
                    "{what}: bytes is read-only, a writable buffer is needed"
                )));
            }
            let s = b.as_bytes();
            return Ok(ByteBuf {
                ptr: s.as_ptr() as *mut u8,
                len: s.len(),
                _owner: b.clone().into_any().unbind(),
            });
        }
        if obj.is_instance_of::<pyo3::types::PyString>() || obj.is_none() {
            return Err(type_err());
        }
        let arr: Bound<'_, PyAny> = if obj.cast::<numpy::PyUntypedArray>().is_ok() {
            obj.clone()
        } else {
            // Through a memoryview, so numpy sees the exporter's format, shape and strides
            // (`numpy.frombuffer` would see only bytes: an object array's pointers, a
            // strided view's span).
            let py = obj.py();
            let mv = py
                .import("builtins")?
                .getattr("memoryview")?
                .call1((obj,))
                .map_err(|_| type_err())?;
            py.import("numpy")?
                .call_method1("asarray", (mv,))
                .map_err(|e| {
                    PyTypeError::new_err(format!("{what}: unsupported buffer format ({e})"))
                })?
        };
        let a = arr
            .cast::<numpy::PyUntypedArray>()
            .map_err(|_| type_err())?;
        if a.dtype().has_object() {
            // Its bytes are addresses of Python objects: storing them leaks heap addresses,
            // writing them corrupts the interpreter.
            return Err(PyTypeError::new_err(format!(
                "{what}: the buffer holds Python objects (dtype {}), not bytes",
                a.dtype()
            )));
        }
        if !a.is_c_contiguous() {
            return Err(PyValueError::new_err(format!(
                "{what}: buffer must be C-contiguous"
            )));
        }
        // SAFETY: a live ndarray; fields read under the GIL.
        let (data, flags) = unsafe {
            let p = a.as_array_ptr();
            ((*p).fields.data as *mut u8, (*p).fields.flags)
        };
        if writable && flags & numpy::npyffi::flags::NPY_ARRAY_WRITEABLE == 0 {
            return Err(PyTypeError::new_err(format!(
                "{what}: buffer is read-only, a writable one is needed"
            )));
        }
        let items: usize = a.shape().iter().product();
        let len = items
            .checked_mul(a.dtype().itemsize())
            .ok_or_else(|| PyValueError::new_err(format!("{what}: buffer too large")))?;
        Ok(ByteBuf {
            _owner: arr.clone().unbind(),
            ptr: data,
            len,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn as_slice(&self) -> &[u8] {
        if self.len == 0 || self.ptr.is_null() {
            return &[];
        }
        // SAFETY: `len` contiguous bytes, alive while `_owner` is held.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// Mutable view; only for buffers obtained with `writable = true`.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        if self.len == 0 || self.ptr.is_null() {
            return &mut [];
        }
        // SAFETY: writable, contiguous, alive while held. Python code racing on the same
        // memory from another thread is a data race on plain bytes, as with any C extension.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}
