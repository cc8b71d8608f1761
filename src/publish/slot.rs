//! The connection slot every transport keeps its broker connection in: the connection in use
//! (if any) and its generation, connects serialised so that concurrent callers open one
//! connection, not many, and `mark_down` that forgets a failed connection only if it is still
//! the one in use (a late failure of a replaced connection must not drop its successor).

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

/// A connection a [`Slot`] holds.
pub trait Connection: Send + Sync + 'static {
    /// The generation [`Slot::get_or_connect`] gave it when it was opened.
    fn generation(&self) -> u64;

    /// Called once when the slot lets go of it (marked down, or replaced on connect): close
    /// it, in the background if closing may block. Handles still held elsewhere keep it alive
    /// until they are dropped. The default does nothing more than drop the slot's handle.
    fn retire(self: Arc<Self>) {}
}

/// One broker connection, replaced as it fails.
pub struct Slot<C> {
    current: RwLock<Option<Arc<C>>>,
    /// The generation of the newest connection: the one in use, or the one being opened (0:
    /// none yet). Shared, so that callbacks of a connection can tell whether theirs is still
    /// the current one.
    generation: Arc<AtomicU64>,
    /// Serialises connects.
    connecting: tokio::sync::Mutex<()>,
}

impl<C> Default for Slot<C> {
    fn default() -> Self {
        Self {
            current: RwLock::new(None),
            generation: Arc::new(AtomicU64::new(0)),
            connecting: tokio::sync::Mutex::new(()),
        }
    }
}

impl<C: Connection> Slot<C> {
    /// An empty slot.
    pub fn new() -> Self {
        Self::default()
    }

    /// The connection in use, if any.
    pub fn get(&self) -> Option<Arc<C>> {
        self.current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The generation of the newest connection (the one in use, or the one being opened; 0:
    /// none yet), as a shared counter: a connection whose generation is below it was
    /// replaced.
    pub fn generation(&self) -> &Arc<AtomicU64> {
        &self.generation
    }

    /// Waits for the other connects to finish; what it returns connects
    /// ([`Connecting::get_or_connect`]), one caller at a time, until it is dropped.
    pub async fn connecting(&self) -> Connecting<'_, C> {
        Connecting {
            slot: self,
            _serial: self.connecting.lock().await,
        }
    }

    /// Forgets connection `generation` if it is still the one in use, and retires it; whether
    /// it was.
    pub fn mark_down(&self, generation: u64) -> bool {
        let old = {
            let mut guard = self.current.write().unwrap_or_else(|p| p.into_inner());
            if guard.as_ref().is_some_and(|c| c.generation() == generation) {
                guard.take()
            } else {
                None
            }
        };
        old.map(C::retire).is_some()
    }

    /// Empties the slot without retiring what it held (for closing it cleanly).
    pub fn take(&self) -> Option<Arc<C>> {
        self.current
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }
}

/// A connect in progress: the other callers of [`Slot::connecting`] wait until it is dropped.
pub struct Connecting<'a, C> {
    slot: &'a Slot<C>,
    _serial: tokio::sync::MutexGuard<'a, ()>,
}

impl<C: Connection> Connecting<'_, C> {
    /// The connection in use when `usable` says it still is; else a new one from `open`
    /// (given its generation), in place of the old one, which is retired first (from then on,
    /// what the old one reports is stale). Callers of [`Slot::connecting`] wait for each
    /// other, so concurrent connects open one connection between them. An error of `open`
    /// leaves the slot empty.
    pub async fn get_or_connect<E, Fut>(
        &self,
        usable: impl FnOnce(&C) -> bool,
        open: impl FnOnce(u64) -> Fut,
    ) -> Result<Arc<C>, E>
    where
        Fut: Future<Output = Result<C, E>>,
    {
        let stale = self.slot.get();
        if let Some(current) = stale.as_ref().filter(|c| usable(c)) {
            return Ok(Arc::clone(current));
        }
        let generation = self.slot.generation.fetch_add(1, Ordering::Relaxed) + 1;
        if let Some(stale) = stale {
            self.slot.mark_down(stale.generation());
        }
        let opened = Arc::new(open(generation).await?);
        *self.slot.current.write().unwrap_or_else(|p| p.into_inner()) = Some(Arc::clone(&opened));
        Ok(opened)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicUsize};

    use super::*;

    /// A fake connection: usable until `up` is cleared; counts its retirements.
    struct Fake {
        generation: u64,
        up: AtomicBool,
        retired: Arc<AtomicUsize>,
    }

    impl Connection for Fake {
        fn generation(&self) -> u64 {
            self.generation
        }

        fn retire(self: Arc<Self>) {
            self.up.store(false, Ordering::Relaxed);
            self.retired.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A slot, the connects it made and the retirements of its connections.
    struct Harness {
        slot: Slot<Fake>,
        opened: AtomicUsize,
        retired: Arc<AtomicUsize>,
    }

    impl Harness {
        fn new() -> Self {
            Self {
                slot: Slot::new(),
                opened: AtomicUsize::new(0),
                retired: Arc::new(AtomicUsize::new(0)),
            }
        }

        /// Connects, opening only if the connection in use is down; the open lets the other
        /// callers run before it ends.
        async fn connect(&self) -> Arc<Fake> {
            self.slot
                .connecting()
                .await
                .get_or_connect(
                    |c| c.up.load(Ordering::Relaxed),
                    |generation| async move {
                        self.opened.fetch_add(1, Ordering::Relaxed);
                        tokio::task::yield_now().await;
                        Ok::<_, ()>(Fake {
                            generation,
                            up: AtomicBool::new(true),
                            retired: Arc::clone(&self.retired),
                        })
                    },
                )
                .await
                .unwrap()
        }
    }

    #[tokio::test]
    async fn concurrent_callers_connect_once() {
        let h = Harness::new();
        let all = futures::future::join_all((0..8).map(|_| h.connect())).await;
        assert_eq!(h.opened.load(Ordering::Relaxed), 1);
        assert!(all.iter().all(|c| Arc::ptr_eq(c, &all[0])));
        assert_eq!(all[0].generation, 1);
        assert_eq!(h.slot.generation().load(Ordering::Relaxed), 1);
        // Usable: connecting again opens nothing.
        h.connect().await;
        assert_eq!(h.opened.load(Ordering::Relaxed), 1);
    }

    #[tokio::test]
    async fn a_stale_generations_mark_down_does_not_drop_a_newer_connection() {
        let h = Harness::new();
        let first = h.connect().await;
        assert!(h.slot.mark_down(first.generation));
        assert!(h.slot.get().is_none());
        assert_eq!(h.retired.load(Ordering::Relaxed), 1);
        let second = h.connect().await;
        assert_eq!(second.generation, 2);
        // A late failure of the first connection.
        assert!(!h.slot.mark_down(first.generation));
        let current = h.slot.get().unwrap();
        assert!(Arc::ptr_eq(&current, &second));
        assert_eq!(h.retired.load(Ordering::Relaxed), 1);
    }

    #[tokio::test]
    async fn an_unusable_connection_is_retired_and_replaced_on_connect() {
        let h = Harness::new();
        let first = h.connect().await;
        first.up.store(false, Ordering::Relaxed);
        let second = h.connect().await;
        assert_eq!(
            (second.generation, h.opened.load(Ordering::Relaxed)),
            (2, 2)
        );
        assert_eq!(h.retired.load(Ordering::Relaxed), 1);
        // Taken to be closed: not retired.
        assert!(h.slot.take().is_some());
        assert_eq!(h.retired.load(Ordering::Relaxed), 1);
        assert!(h.slot.get().is_none());
    }

    #[tokio::test]
    async fn a_failed_open_leaves_the_slot_empty() {
        let slot: Slot<Fake> = Slot::new();
        let failed = slot
            .connecting()
            .await
            .get_or_connect(|_| true, |_| async { Err::<Fake, _>("refused") })
            .await;
        assert_eq!(failed.err(), Some("refused"));
        assert!(slot.get().is_none());
        assert_eq!(slot.generation().load(Ordering::Relaxed), 1);
        let retired = Arc::new(AtomicUsize::new(0));
        let opened = slot
            .connecting()
            .await
            .get_or_connect(
                |_| true,
                |generation| async move {
                    Ok::<_, ()>(Fake {
                        generation,
                        up: AtomicBool::new(true),
                        retired,
                    })
                },
            )
            .await
            .unwrap();
        assert_eq!(opened.generation, 2);
    }
}
