//! A reader that bounds one CSV/TSV record by bytes. The csv crate grows a record for as long as
//! its input lasts: one unterminated quote before 512 MiB of data (a 16 KB zstd file) grew
//! `publish` to 2.1 GB, and a process killed for memory never got past that row on a re-run. The
//! crate has no such bound, so the reader under it fails once a record runs past
//! [`Bounded::max`] bytes; the caller refuses the record and goes on from the next line.

use std::cell::Cell;
use std::io::{BufRead, Read};
use std::rc::Rc;

/// Where the current record started and how far the input has been read, shared between the
/// reader (inside the csv reader) and the loop that reads records.
#[derive(Debug, Default)]
pub struct Marks {
    /// Bytes read from the input so far.
    read: Cell<u64>,
    /// Where the current record starts, in the input's bytes.
    start: Cell<u64>,
}

impl Marks {
    /// A record starts at `at` (the csv reader's position plus where that reader began).
    pub fn start_at(&self, at: u64) {
        self.start.set(at);
    }

    /// Bytes read from the input so far.
    pub fn read(&self) -> u64 {
        self.read.get()
    }
}

/// The input, failing a read with [`TooLong`] once the current record holds more than `max`
/// bytes (as far as the csv reader's own buffer lets us see: up to its size more).
pub struct Bounded<R> {
    inner: R,
    marks: Rc<Marks>,
    /// The longest record allowed, in bytes.
    pub max: u64,
}

/// The error a read past the bound gives (inside the csv crate's I/O error).
#[derive(Debug)]
pub struct TooLong(pub u64);

impl std::fmt::Display for TooLong {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "a record longer than {} bytes", self.0)
    }
}

impl std::error::Error for TooLong {}

impl<R: BufRead> Bounded<R> {
    /// `inner` bounded to records of `max` bytes, with the marks it shares.
    pub fn new(inner: R, max: u64) -> (Self, Rc<Marks>) {
        let marks = Rc::new(Marks::default());
        let bounded = Self {
            inner,
            marks: marks.clone(),
            max,
        };
        (bounded, marks)
    }

    /// Reads on to just past the next newline, unbounded and keeping nothing: what is left of
    /// a record refused for its length. False at the end of the input.
    pub fn skip_line(&mut self) -> std::io::Result<bool> {
        loop {
            let buf = self.inner.fill_buf()?;
            if buf.is_empty() {
                return Ok(false);
            }
            let (n, found) = match buf.iter().position(|&b| b == b'\n') {
                Some(at) => (at + 1, true),
                None => (buf.len(), false),
            };
            self.inner.consume(n);
            self.marks.read.set(self.marks.read.get() + n as u64);
            if found {
                return Ok(true);
            }
        }
    }
}

impl<R: BufRead> Read for Bounded<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let (read, start) = (self.marks.read.get(), self.marks.start.get());
        if read.saturating_sub(start) > self.max {
            return Err(std::io::Error::other(TooLong(self.max)));
        }
        let n = self.inner.read(buf)?;
        self.marks.read.set(read + n as u64);
        Ok(n)
    }
}

/// Whether a csv error is a record past the bound.
pub fn is_too_long(e: &csv::Error) -> bool {
    match e.kind() {
        csv::ErrorKind::Io(io) => io.get_ref().is_some_and(|inner| inner.is::<TooLong>()),
        _ => false,
    }
}
