"""The frame path: capture -> preprocess -> infer (batched per slot) -> postprocess -> publish.

Stages are threads joined by bounded queues (:mod:`agent.runtime.frames.stage_queue`). Capture threads decode
and preprocess (cv2 and numpy release the GIL, so this overlaps with inference); the slot's
inference workers (one, or one per core: :mod:`agent.runtime.frames.layout`) lease ``slot`` per batch,
which is what makes a hot-swap a reference swap; one publish thread per slot postprocesses and
publishes, in the order batches were taken (:mod:`agent.runtime.frames.publish_stage`), or a lone worker
publishes its own batches (:func:`publishes_inline`). Shutdown drains front to back: captures stop,
the workers empty the inbox, the publisher empties the outbox.

One job (the stages and their threads): the call tracking the watchdog reads, the health hooks
probation reads and the per-engine leases are each a few lines inside the stage loops they watch;
what travels between the stages is in :mod:`agent.runtime.frames.stage_items`."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import numpy.typing as npt
import structlog

from agent.camera.frame import Frame
from agent.camera.framing import framed
from agent.camera.gpu_preprocess import GpuPreprocessor
from agent.camera.preprocess import preprocess, resize_fit
from agent.errors import AgentError
from agent.runtime.frames.outbox import OrderedOutbox
from agent.runtime.frames.publish_stage import PublishStage
from agent.runtime.frames.snapshots import SnapshotBoard
from agent.runtime.frames.stage_items import (
    FrameTap,
    InferredItem,
    Publisher,
    StreamMetrics,
    StreamPlan,
    StreamTuning,
    WorkItem,
)
from agent.runtime.frames.stage_queue import SlotInbox
from agent.runtime.slots.loaded import LoadedModel
from agent.runtime.slots.slot import ModelSlot
from agent.specs.preprocess import PreprocessSpec
from agent.telemetry import Metrics
from agent.watchdog.liveness import CallWatch

log = structlog.get_logger(__name__)

_POLL_S = 0.1
#: What an inferred frame keeps instead of its image and tensor: the publisher needs neither, and
#: holding them while results wait for the spool would make memory grow with the wait.
_RELEASED_IMAGE: npt.NDArray[np.uint8] = np.zeros((0, 0, 3), np.uint8)
_RELEASED_TENSOR: npt.NDArray[Any] = np.zeros((0,), np.float32)


class SlotPipeline:
    """All stages for one slot: capture threads of its streams, one inference and one publish thread."""

    def __init__(
        self,
        slot: ModelSlot,
        streams: list[StreamPlan],
        publisher: Publisher,
        metrics: Metrics,
        *,
        max_batch: int = 4,
        publish_queue: int = 64,
        workers: int = 1,
        publish_wake: int = 1,
    ) -> None:
        self.slot = slot
        self.streams = streams
        self._metrics = metrics
        self._max_batch = max_batch
        # Several inference threads run batches side by side (a session/engine may be run from many
        # threads; TensorRT gets one execution context per thread). The last one out closes the outbox.
        self._workers = max(1, workers)
        self._workers_running = self._workers
        self._workers_lock = threading.Lock()
        # One per inference worker: the heartbeat below is shared, so a worker stuck inside
        # runner.infer stays invisible while another one idles and refreshes it.
        self._infer_calls = [CallWatch() for _ in range(self._workers)]
        self._running_threads: list[threading.Thread] = []
        self._stream_metrics = {plan.name: StreamMetrics(metrics, plan.name) for plan in streams}
        self._infer_hist = metrics.histogram(f"slot.{slot.name}.latency.infer")
        self._batches = metrics.counter(f"slot.{slot.name}.batches")
        self._inbox: SlotInbox[WorkItem] = SlotInbox(on_drop=self._dropped_in_queue)
        for plan in streams:
            self._inbox.add_lane(plan.name, plan.queue_size, plan.policy)
        self._outbox: OrderedOutbox[InferredItem] = OrderedOutbox(publish_queue, publish_wake)
        # Batches are numbered as they are taken, under this lock, so the outbox can restore the
        # inbox's order however the workers finish.
        self._take_lock = threading.Lock()
        self._taken = 0
        self._capture_stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._capture_threads: list[threading.Thread] = []
        self._captures_running = len(streams)
        self._captures_lock = threading.Lock()
        self.last_image: npt.NDArray[np.uint8] | None = None
        #: The latest frame of each stream with its result, for the ``snapshot`` command (references).
        self.snapshots = SnapshotBoard()
        self._publish = PublishStage(
            slot.name, self._outbox, publisher, self._stream_metrics, self.snapshots, poll_s=_POLL_S
        )
        #: A lone inference worker publishes its own batches (see :func:`publishes_inline`).
        self.inline_publish = publishes_inline(self._workers, streams)
        self._taps: list[FrameTap] = []
        self._taps_lock = threading.Lock()
        self.heartbeat = time.monotonic()
        metrics.add_collector(self._depths, prefix=f"slot.{slot.name}.")

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        for plan in self.streams:
            t = threading.Thread(target=self._capture, args=(plan,), name=f"capture-{plan.name}", daemon=True)
            self._capture_threads.append(t)
        infer = [
            threading.Thread(
                target=self._infer_loop, args=(calls, i), name=f"infer-{self.slot.name}-{i}", daemon=True
            )
            for i, calls in enumerate(self._infer_calls)
        ]
        publish = (
            []
            if self.inline_publish
            else [threading.Thread(target=self._publish.run, name=f"publish-{self.slot.name}", daemon=True)]
        )
        self._running_threads = [*infer, *publish]
        self._threads = [*self._capture_threads, *infer, *publish]
        for t in self._threads:
            t.start()

    def stop(self, deadline: float) -> None:
        """Stop capture, then let inference and publishing drain what was captured, until ``deadline``."""
        self._capture_stop.set()
        for t in self._capture_threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self._inbox.close()
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        for plan in self.streams:
            plan.source.close()
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck:
            log.warning("pipeline.stop.timeout", slot=self.slot.name, threads=stuck)

    def healthy(self, stale_s: float, call_bound_s: float | None = None) -> bool:
        """For the systemd watchdog: True when :meth:`problems` finds none."""
        return not self.problems(stale_s, call_bound_s)

    def problems(self, stale_s: float, call_bound_s: float | None = None) -> list[str]:
        """What keeps this pipeline from being alive, one sentence each; empty when it is alive.

        Alive means: the inference and publish threads run, the inference loop turned over within
        ``stale_s``, and no camera driver call (open/read/close) and no inference call has been in
        progress for longer than ``call_bound_s`` (None: calls are not checked). A camera that is
        reconnecting waits outside the driver, and an idle loop is between calls: both are alive.
        A pipeline whose streams all ended on purpose (play-once files) is finished, not dead.
        """
        if self.finished:
            return []
        problems = [f"thread {t.name} has ended" for t in self._running_threads if not t.is_alive()]
        if not self._running_threads:
            problems.append(f"slot {self.slot.name}: pipeline not started")
        idle = time.monotonic() - self.heartbeat
        if idle >= stale_s:
            problems.append(f"slot {self.slot.name}: inference loop has not turned over for {idle:.1f} s")
        if call_bound_s is not None:
            for plan in self.streams:
                call = plan.source.driver_call()
                if call is not None and call.seconds > call_bound_s:
                    problems.append(
                        f"stream {plan.name}: camera driver {call.what}() has not returned "
                        f"for {call.seconds:.1f} s"
                    )
            for i, calls in enumerate(self._infer_calls):
                stuck = calls.over(call_bound_s)
                if stuck is not None:
                    problems.append(
                        f"slot {self.slot.name}: inference worker {i} has been in {stuck.what}() "
                        f"for {stuck.seconds:.1f} s"
                    )
        return problems

    @property
    def finished(self) -> bool:
        """True once every stream ended by itself (play-once files) and everything was published."""
        return bool(self._threads) and not any(t.is_alive() for t in self._threads)

    # -- stages ------------------------------------------------------------------------------

    def _capture(self, plan: StreamPlan) -> None:
        sm = self._stream_metrics[plan.name]
        captured, skipped, no_model = sm.captured, sm.dropped["fps_limit"], sm.dropped["no_model"]
        pre_hist = sm.preprocess
        last_taken = -1e9
        try:
            for captured_frame in plan.source.frames(self._capture_stop):
                captured.inc()
                tuning = plan.tuning.current
                frame = captured_frame
                if tuning.fps_limit and frame.captured_mono - last_taken < 1.0 / tuning.fps_limit:
                    skipped.inc()
                    continue
                last_taken = frame.captured_mono
                if not tuning.framing.is_identity:
                    # Turned and cut before anything sees it: results, snapshots and samples are in
                    # the framed image's pixels, so the camera's own size no longer maps them.
                    frame = Frame(
                        frame.stream,
                        frame.index,
                        framed(frame.image, tuning.framing),
                        frame.captured_at,
                        frame.captured_mono,
                        frame.meta,
                    )
                self.last_image = frame.image
                if self._taps:
                    self._feed_taps(frame.image)
                model = self.slot.current
                if model is None:
                    no_model.inc()
                    continue
                model.health.offered(plan.name)
                t0 = time.perf_counter()
                tensor: npt.NDArray[Any] | None
                if model.gpu_preprocessor is not None and model.preprocessed_on_gpu:
                    # Left to the inference worker, which uploads the frame as decoded and fills the
                    # engine's input on the GPU: the CPU never touches the full-size pixels again.
                    # The next frames are decoded into page-locked memory, uploaded without a copy.
                    plan.source.decode_into(model.gpu_preprocessor.pinned.empty)
                    height, width = frame.image.shape[:2]
                    tensor, letterbox = None, resize_fit(width, height, model.preprocess).letterbox
                else:
                    tensor, letterbox = preprocess(frame.image, model.preprocess)
                pre_ms = (time.perf_counter() - t0) * 1000.0
                pre_hist.observe(pre_ms / 1000.0)
                item = WorkItem(frame, tensor, letterbox, model.preprocess, plan, pre_ms, time.monotonic())
                while not self._inbox.put(plan.name, item, timeout=_POLL_S):
                    if self._capture_stop.is_set():
                        sm.dropped["shutdown"].inc()
                        break
        except Exception:
            log.exception("pipeline.capture.crashed", stream=plan.name)
        finally:
            self._capture_ended()
        log.info("pipeline.capture.ended", stream=plan.name, state=plan.source.state.value)

    def retune(self, stream: str, tuning: StreamTuning) -> bool:
        """Give stream ``stream`` a new tuning from its next frame on; False: no such stream here.

        Only that stream's capture thread reads it: its source stays open, its frame numbers go on,
        and the other streams never notice."""
        for plan in self.streams:
            if plan.name == stream:
                plan.tuning.current = tuning
                return True
        return False

    def tap(self, n: int, *, every: int = 1, timeout_s: float = 30.0) -> list[npt.NDArray[np.uint8]]:
        """Copies of the next ``n`` captured frames (one in ``every``), for calibration and the INT8 guard.

        Blocks until they are there or ``timeout_s`` passes (then returns what it has). Costs nothing
        while no one is tapping: frames are copied only for a running tap.
        """
        tap = FrameTap(n, every)
        with self._taps_lock:
            self._taps.append(tap)
        try:
            tap.done.wait(timeout_s)
        finally:
            with self._taps_lock:
                self._taps.remove(tap)
        return list(tap.frames)

    def _feed_taps(self, image: npt.NDArray[np.uint8]) -> None:
        with self._taps_lock:
            taps = list(self._taps)
        for tap in taps:
            tap.offer(image)

    def _capture_ended(self) -> None:
        # When the last stream has ended by itself (play-once files), nothing more can arrive:
        # close the inbox so inference and publishing drain and end, and ``finished`` turns True.
        with self._captures_lock:
            self._captures_running -= 1
            last = self._captures_running == 0
        if last:
            self._inbox.close()

    def _dropped_in_queue(self, stream: str, _item: WorkItem) -> None:
        self._stream_metrics[stream].dropped["queue_full"].inc()
        model = self.slot.current
        if model is not None:
            model.health.dropped()

    def _infer_loop(self, calls: CallWatch, worker: int = 0) -> None:
        # A slot on several devices: this worker owns engine ``worker`` (modulo the set's size) of
        # whatever set is current, so frames go to whichever worker, hence device, is free.
        while True:
            self.heartbeat = time.monotonic()
            results: list[InferredItem] = []
            model: LoadedModel | None = None
            # Numbered and leased in one step, in take order: a later batch can never run on an
            # older model than an earlier one, so a stream's results never switch back after a swap.
            with self._take_lock:
                batch = self._inbox.take(self._max_batch, timeout=_POLL_S)
                number = self._taken
                if batch:
                    self._taken += 1
                    model = self.slot.acquire(worker)
            if not batch:
                if self._inbox.drained:
                    break
                continue
            try:
                results = self._infer_batch(batch, model, calls)
            except Exception:
                log.exception("pipeline.infer.crashed", slot=self.slot.name)
            finally:
                # Handed in even when empty: later batches wait for this number.
                while not self.inline_publish and not self._outbox.put(number, results, timeout=_POLL_S):
                    # Back-pressure from the publisher (the spool, the link): alive, waiting.
                    # The publisher always drains; results are never dropped here.
                    self.heartbeat = time.monotonic()
                if model is not None:
                    model.release()
            if results and self.inline_publish:
                # After the lease: a swap waiting for this batch's engine need not wait for the link.
                self._publish.publish(results)
        with self._workers_lock:
            self._workers_running -= 1
            last = self._workers_running == 0
        if last:
            self._outbox.close()

    def _feed(self, chunk: list[WorkItem], spec: PreprocessSpec, gpu: GpuPreprocessor | None) -> Any:
        """The batch tensor: the CPU tensors stacked, or a device tensor filled by the GPU kernel."""
        if gpu is None:
            tensors = [w.tensor for w in chunk if w.tensor is not None]
            if len(tensors) == 1:
                # A batch of one (most batches of a slot that keeps up): a view with a batch axis,
                # not a copy of the tensor into a fresh array.
                return tensors[0][np.newaxis]
            return np.stack(tensors)
        t0 = time.perf_counter()
        tensor, letterboxes = gpu.batch([w.frame.image for w in chunk])
        per_frame_s = (time.perf_counter() - t0) / len(chunk)
        for work, letterbox in zip(chunk, letterboxes, strict=True):
            work.letterbox, work.spec = letterbox, spec
            work.pre_ms += per_frame_s * 1000.0
            self._stream_metrics[work.plan.name].preprocess.observe(per_frame_s)
        return tensor

    def _infer_batch(
        self, batch: list[WorkItem], model: LoadedModel | None, calls: CallWatch | None = None
    ) -> list[InferredItem]:
        calls = calls or CallWatch()
        now = time.monotonic()
        done: list[tuple[list[WorkItem], dict[str, npt.NDArray[Any]], float]] = []
        if model is None:
            for work in batch:
                self._stream_metrics[work.plan.name].dropped["no_model"].inc()
            return []
        spec = model.preprocess
        gpu = model.gpu_preprocessor
        if gpu is None:
            for work in batch:
                if work.tensor is None or (work.spec is not spec and work.spec != spec):
                    # Preprocessed for the model that was swapped out while this frame waited, or
                    # left for a GPU that this engine of the set does not use.
                    work.tensor, work.letterbox = preprocess(work.frame.image, spec)
                    work.spec = spec
        # A model exported with a fixed batch size (often 1) takes at most that many frames
        # per run, whatever max_batch says; a larger stack would fail every run.
        step = model.runner.max_batch or len(batch)
        for start in range(0, len(batch), step):
            chunk = batch[start : start + step]
            calls.enter("infer")
            try:
                feed = self._feed(chunk, spec, gpu)
                # After the feed: GPU preprocessing counts as preprocessing, not as inference.
                t0 = time.perf_counter()
                outputs = model.runner.infer({model.input_name: feed})
            except AgentError as exc:
                for work in chunk:
                    self._stream_metrics[work.plan.name].dropped["infer_error"].inc()
                model.health.failed(len(chunk))
                log.error("pipeline.infer.failed", slot=self.slot.name, error=str(exc))
                continue
            finally:
                calls.leave()
            done.append((chunk, outputs, (time.perf_counter() - t0) * 1000.0))
        results: list[InferredItem] = []
        for chunk, outputs, infer_ms in done:
            self._infer_hist.observe(infer_ms / 1000.0)
            self._batches.inc()
            # Only a model on probation pays for the NaN/Inf check (one isfinite pass per batch).
            nan_frames = _nan_frames(outputs, len(chunk)) if model.health.watch_outputs else 0
            model.health.inferred(infer_ms, nan_frames=nan_frames)
            model.results_pending(len(chunk))
            model.counted(len(chunk))
            for i, work in enumerate(chunk):
                self.snapshots.inferred(work.plan.name, work.frame.index, work.frame.image)
                work.frame = work.frame.with_image(_RELEASED_IMAGE)
                work.tensor = _RELEASED_TENSOR
                results.append(
                    InferredItem(
                        work=work,
                        outputs={name: array[i] for name, array in outputs.items()},
                        model=model,
                        queue_ms=(now - work.queued_mono) * 1000.0,
                        infer_ms=infer_ms,
                        batch=len(chunk),
                    )
                )
                self._stream_metrics[work.plan.name].inferred.inc()
        return results

    def _depths(self) -> dict[str, float]:
        depths: dict[str, float] = {f"queue.{k}": float(v) for k, v in self._inbox.depths().items()}
        depths["queue.publish"] = float(self._outbox.depth)
        return depths


def publishes_inline(workers: int, streams: list[StreamPlan]) -> bool:
    """Whether the slot's inference worker publishes its own batches, with no publish thread (pure).

    With one worker, batches already come out in take order, and handing each one to a publish
    thread cost a thread wake-up and a sleep per batch (most batches of a slot that keeps up are one
    frame): on two cores, the tiny-model case spent more CPU on those hand-offs than on publishing.
    Several workers still need the outbox to restore the take order. A durable stream keeps the
    publish thread too: the spool's fsync per batch would stall inference instead of overlapping it.
    """
    return workers == 1 and not any(plan.durable for plan in streams)


def _nan_frames(outputs: dict[str, npt.NDArray[Any]], frames: int) -> int:
    """How many of a batch's ``frames`` have a NaN or infinite value in any float output."""
    bad = np.zeros(frames, dtype=bool)
    for array in outputs.values():
        if array.dtype.kind == "f" and array.shape[:1] == (frames,):
            bad |= ~np.isfinite(array.reshape(frames, -1)).all(axis=1)
    return int(bad.sum())
