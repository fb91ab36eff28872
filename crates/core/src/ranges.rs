//! Named ranges the policies and the toolkit pass around instead of positional tuples: a
//! run of KV heads ([`HeadRange`], a head-wise unit's heads, HeadInfer §3.2) and a run of
//! token positions ([`TokenRange`], the history a unit attends).

/// KV heads `first..first + count`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HeadRange {
    /// The first head.
    pub first: usize,
    /// How many heads.
    pub count: usize,
}

impl HeadRange {
    /// Heads `first..first + count`.
    pub fn new(first: usize, count: usize) -> Self {
        Self { first, count }
    }

    /// One past the last head.
    pub fn end(&self) -> usize {
        self.first + self.count
    }

    /// Whether the two ranges share a head.
    pub fn overlaps(&self, other: &HeadRange) -> bool {
        self.first < other.end() && other.first < self.end()
    }
}

/// Token positions `start..start + len`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TokenRange {
    /// The first position.
    pub start: usize,
    /// How many positions.
    pub len: usize,
}

impl TokenRange {
    /// Positions `start..start + len`.
    pub fn new(start: usize, len: usize) -> Self {
        Self { start, len }
    }

    /// One past the last position.
    pub fn end(&self) -> usize {
        self.start + self.len
    }
}
