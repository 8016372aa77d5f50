//! One CUDA device as the backend uses it: its context and stream(s),
//! kernels and tables, and the two ways a part ends: releasing a consumer
//! stream behind its copies, and waiting for them (spinning, or on a
//! blocking-sync event once a consumer was released). The only unsafe code
//! here is `cuStreamWaitEvent` on a consumer's foreign stream handle, argued
//! at the call.

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
    /// Second stream of [`GatherUpload::Pipelined2`] (created on its first
    /// use): odd chunks of a pipelined part run on it.
    pub(super) aux: Option<Arc<CudaStream>>,
    /// A launch was issued on `aux` since the last [`Device::sync`].
    pub(super) aux_in_flight: bool,
    /// Piece tables of block-major rows by block and piece length: a part
    /// launched from its plan's packed rows builds none.
    pub(super) row_pieces: crate::cuda_gather::ContiguousPieces,
    /// Packed-id Vec of the last direct gather, handed to the next one
    /// ([`RunsGather::with_words`]): a scattered fetch allocates no id
    /// table and writes into memory it already touched.
    pub(super) words: Vec<u32>,
    pub(super) peers: HashMap<u32, bool>,
    /// Recorded after a part's copies for a [`ConsumerStream`] to wait on
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
        self.released = true;
        Ok(())
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
