//! A buffer written at disjoint indices from candle's worker threads: each task of a
//! parallel loop owns its indices, so no two threads touch one element.

/// The output buffer, written at disjoint indices from candle's worker threads.
pub(crate) struct Disjoint<T>(pub(crate) *mut T);
// SAFETY: every user hands each index to one task, so one thread writes it (see the
// SAFETY comments at the writes).
unsafe impl<T> Sync for Disjoint<T> {}

impl<T> Disjoint<T> {
    /// Writes `v` at index `i`.
    ///
    /// # Safety
    /// `i` is in bounds, and no other thread reads or writes index `i` meanwhile.
    pub(crate) unsafe fn write(&self, i: usize, v: T) {
        self.0.add(i).write(v)
    }

    /// The element at index `i`, as a pointer.
    ///
    /// # Safety
    /// `i` is in bounds.
    pub(crate) unsafe fn at(&self, i: usize) -> *mut T {
        self.0.add(i)
    }

    /// Elements `range` as a slice.
    ///
    /// # Safety
    /// `range` is in bounds, and no other thread reads or writes it while the slice lives.
    #[allow(clippy::mut_from_ref)] // disjoint ranges per thread: the point of the type
    pub(crate) unsafe fn slice(&self, range: std::ops::Range<usize>) -> &mut [T] {
        std::slice::from_raw_parts_mut(self.0.add(range.start), range.len())
    }
}
