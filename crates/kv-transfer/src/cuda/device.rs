//! One CUDA device as the backend uses it: its context and stream(s),
//! kernels and tables, and the two ways a part ends: releasing a consumer
//! stream behind its copies, and waiting for them (spinning, or on a
//! blocking-sync event once a consumer was released), or releasing it layer
//! group by layer group. The only unsafe code here is `cuStreamWaitEvent` on
//! a consumer's foreign stream handle (at the release, or later from a
//! layer group's `LayersReady`), argued at each call.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaStream};

use super::cuda_err;
use super::launch::{Kernels, Tables};
use crate::{DeliveryControl, TransferError};

pub(super) struct Device {
    pub(super) ctx: Arc<CudaContext>,
    pub(super) stream: Arc<CudaStream>,
    /// Entry points of the converting gather (absent without libnvrtc).
    pub(super) kernels: Option<Kernels>,
    /// Streaming multiprocessors (sizes the grid).
    pub(super) sms: u32,
    /// Block and piece tables of the launches on this device.
    pub(super) tables: Tables,
    /// Second stream of [`GatherUpload::Pipelined2`](crate::cuda_gather::GatherUpload::Pipelined2) (created on its first
    /// use): odd chunks of a pipelined part run on it.
    pub(super) aux: Option<Arc<CudaStream>>,
    /// A launch was issued on `aux` since the last [`Device::sync`].
    pub(super) aux_in_flight: bool,
    /// Piece tables of block-major rows by block and piece length: a part
    /// launched from its plan's packed rows builds none.
    pub(super) row_pieces: crate::cuda_gather::ContiguousPieces,
    /// Packed-id Vec of the last direct gather, handed to the next one
    /// ([`RunsGather::with_words`](crate::cuda_gather::RunsGather::with_words)): a scattered fetch allocates no id
    /// table and writes into memory it already touched.
    pub(super) words: Vec<u32>,
    pub(super) peers: HashMap<u32, bool>,
    /// Recorded after a part's copies for a [`ConsumerStream`](crate::ConsumerStream) to wait on
    /// (created on first use, re-recorded per part: a wait captures the
    /// event's state when it is enqueued).
    pub(super) enqueued: Option<cudarc::driver::CudaEvent>,
    /// Created with `CU_EVENT_BLOCKING_SYNC`: waited on instead of spinning
    /// in `cuStreamSynchronize` once a consumer stream was released.
    pub(super) blocking: Option<cudarc::driver::CudaEvent>,
    /// A consumer stream was released behind this part's copies (reset by
    /// [`Device::sync`]).
    pub(super) released: bool,
}

impl Device {
    /// Makes `control`'s consumer stream, when it is on this device, wait
    /// for everything issued on this device's stream (and on `aux` when a
    /// launch went there since the last sync) so far, then tells the
    /// caller (rank `rank`). A consumer on another device is left alone: its
    /// rows are delivered by that device's part.
    pub(super) fn release_consumer(
        &mut self,
        control: &DeliveryControl,
        rank: u32,
    ) -> Result<(), TransferError> {
        let Some(c) = control.consumer.as_ref() else {
            return Ok(());
        };
        if c.ordinal() != self.ctx.ordinal() as u32 {
            return Ok(());
        }
        if self.enqueued.is_none() {
            self.enqueued = Some(
                self.ctx
                    .new_event(None)
                    .map_err(cuda_err("cuEventCreate"))?,
            );
        }
        let ev = self.enqueued.as_ref().expect("created above");
        let aux = self.aux.as_ref().filter(|_| self.aux_in_flight);
        // A wait captures the event's state when enqueued, so one event
        // serves both streams: recorded on each, waited for after each.
        for stream in std::iter::once(&self.stream).chain(aux) {
            ev.record(stream).map_err(cuda_err("cuEventRecord"))?;
            // SAFETY: the event is alive (owned by this device, destroyed
            // only with it); `ConsumerStream::new`'s contract makes
            // `c.stream()` a live stream of this device's primary context
            // (the context of `self.ctx`) for as long as the delivery runs.
            unsafe {
                cudarc::driver::result::stream::wait_event(
                    c.stream() as cudarc::driver::sys::CUstream,
                    ev.cu_event(),
                    cudarc::driver::sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
            }
            .map_err(cuda_err("cuStreamWaitEvent"))?;
        }
        c.notify(rank);
        // A consumer released by layer group gets this part as one group of
        // every layer: its stream waits already, so the group's wait is empty.
        if c.layer_groups().is_some() {
            c.notify_layers(crate::LayersReady::new(
                rank,
                0..u32::MAX,
                Arc::new(|_| Ok(())),
            ));
        }
        self.released = true;
        Ok(())
    }

    /// Hands layers `layers` of rank `rank`'s converting part to `control`'s
    /// consumer (when it is on this device and asked for layer groups): a
    /// fresh event recorded on the main stream after the launches issued so
    /// far, which [`crate::LayersReady::enqueue_wait`] makes the consumer's
    /// stream wait for. The event lives as long as the `LayersReady` (the
    /// consumer may enqueue its wait after this part returned).
    pub(super) fn release_layers(
        &mut self,
        control: &DeliveryControl,
        rank: u32,
        layers: std::ops::Range<u32>,
    ) -> Result<(), TransferError> {
        let Some(c) = control.consumer.as_ref() else {
            return Ok(());
        };
        if c.ordinal() != self.ctx.ordinal() as u32 {
            return Ok(());
        }
        let ev = self
            .ctx
            .new_event(None)
            .map_err(cuda_err("cuEventCreate"))?;
        ev.record(&self.stream).map_err(cuda_err("cuEventRecord"))?;
        // The consumer may keep the `LayersReady`, and a child forked from
        // this process inherit it: there its wait is refused and its drop
        // forgets the event (`cuEventDestroy` on the parent's state).
        let ev = Arc::new(super::ProcessBound::new(
            ev,
            "this layer group's CUDA event was recorded",
        ));
        let wait = Arc::new(move |on: &crate::ConsumerStream| {
            ev.usable()?;
            // SAFETY: the event is alive (this closure owns a reference);
            // `ConsumerStream::new`'s contract makes `on.stream()` a live
            // stream of its device's primary context while it is used, and
            // the driver accepts an event of another context or device.
            unsafe {
                cudarc::driver::result::stream::wait_event(
                    on.stream() as sys::CUstream,
                    ev.cu_event(),
                    sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
            }
            .map_err(cuda_err("cuStreamWaitEvent"))
        });
        c.notify_layers(crate::LayersReady::new(rank, layers, wait));
        Ok(())
    }

    /// Ends a part of rank `rank` that was released layer group by layer
    /// group ([`Device::release_layers`]): when nothing `failed`, tells the
    /// consumer the part is issued (no whole-stream wait: each group has
    /// its own); then synchronizes, blocking rather than spinning (the
    /// engine is launching its forward meanwhile). The first error wins.
    pub(super) fn settle_layered(
        &mut self,
        control: &DeliveryControl,
        rank: u32,
        failed: Option<TransferError>,
    ) -> Result<(), TransferError> {
        if failed.is_none() {
            if let Some(c) = control
                .consumer
                .as_ref()
                .filter(|c| c.ordinal() == self.ctx.ordinal() as u32)
            {
                c.notify(rank);
                self.released = true;
            }
        }
        let synced = self.sync();
        match failed {
            Some(e) => Err(e),
            None => synced,
        }
    }

    /// Waits for everything issued on the stream (and `aux`) by blocking on
    /// an event instead of spinning: once an engine's stream waits behind
    /// the copies, the engine's thread is launching its forward, and a
    /// thread spinning in `cuStreamSynchronize` on the same context takes
    /// CPU and driver time from those launches (a host-bound forward ran
    /// ~3 ms slower beside it on the H200). Completion is a little later to
    /// notice, which nothing waits on: the engine's stream is ordered by
    /// the event already.
    pub(super) fn wait_blocking(&mut self) -> Result<(), TransferError> {
        if self.blocking.is_none() {
            self.blocking = Some(
                self.ctx
                    .new_event(Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC))
                    .map_err(cuda_err("cuEventCreate"))?,
            );
        }
        let ev = self.blocking.as_ref().expect("created above");
        let aux = self.aux.as_ref().filter(|_| self.aux_in_flight);
        let mut first = Ok(());
        for stream in std::iter::once(&self.stream).chain(aux) {
            let r = ev
                .record(stream)
                .map_err(cuda_err("cuEventRecord"))
                .and_then(|()| ev.synchronize().map_err(cuda_err("cuEventSynchronize")));
            if first.is_ok() {
                first = r;
            }
        }
        first
    }

    /// Ends a part of rank `rank`: when nothing `failed`, releases
    /// `control`'s consumer; then synchronizes whatever happened, since the
    /// caller releases the destination reservation and the donor pins as
    /// soon as the part returns. The first error wins: `failed`, the
    /// release's, the synchronization's.
    pub(super) fn settle(
        &mut self,
        control: &DeliveryControl,
        rank: u32,
        failed: Option<TransferError>,
    ) -> Result<(), TransferError> {
        let failed = match failed {
            None => self.release_consumer(control, rank).err(),
            f => f,
        };
        let synced = self.sync();
        match failed {
            Some(e) => Err(e),
            None => synced,
        }
    }

    /// Waits for everything issued on the stream (and on `aux` when a
    /// launch went there since the last sync); afterwards nothing reads the
    /// table staging buffer. Both streams are waited for even when the
    /// first wait fails; the first error is returned.
    pub(super) fn sync(&mut self) -> Result<(), TransferError> {
        if std::mem::take(&mut self.released) {
            // A failed blocking wait falls through to the plain
            // synchronize below, which must succeed before anything is
            // reported quiesced.
            if self.wait_blocking().is_ok() {
                self.tables.quiesced();
                self.aux_in_flight = false;
                return Ok(());
            }
        }
        let main = self
            .stream
            .synchronize()
            .map_err(cuda_err("cuStreamSynchronize"));
        let aux = match (&self.aux, self.aux_in_flight) {
            (Some(a), true) => a.synchronize().map_err(cuda_err("cuStreamSynchronize")),
            _ => Ok(()),
        };
        if main.is_ok() && aux.is_ok() {
            self.tables.quiesced();
            self.aux_in_flight = false;
        }
        main.and(aux)
    }
}
