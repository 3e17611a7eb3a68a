"""The last stage of the frame path: each inferred frame postprocessed into its result and published.

One thread per slot runs :meth:`PublishStage.run`. It takes results from the slot's outbox in the
order the inference workers took their batches (:mod:`agent.runtime.frames.outbox`), so a stream's results
go out in frame order however the workers finish. A slot with one inference worker and no durable
stream has no publish thread: the worker calls :meth:`PublishStage.publish` on its own batches
(:func:`agent.runtime.frames.pipeline.publishes_inline`). A stream's results are published at its QoS, or,
for a durable stream, stored in the spool first, a whole batch in one transaction. After each
result: the stream's counters and latency histograms, the frame's snapshot pairing (and through it
the opt-in sampler), and the model's health figures that probation reads.
"""

from __future__ import annotations

import time

import structlog

from agent.camera.preprocess import in_native_pixels
from agent.protocol.messages import ResultMessage
from agent.runtime.frames.outbox import OrderedOutbox
from agent.runtime.frames.snapshots import SnapshotBoard
from agent.runtime.frames.stage_items import InferredItem, Publisher, StreamMetrics

log = structlog.get_logger(__name__)

#: Most results the publisher takes at once; durable ones among them are spooled in one transaction.
PUBLISH_BATCH = 32


class PublishStage:
    """Postprocesses and publishes one slot's results, in order, until its outbox is drained."""

    def __init__(
        self,
        slot: str,
        outbox: OrderedOutbox[InferredItem],
        publisher: Publisher,
        stream_metrics: dict[str, StreamMetrics],
        snapshots: SnapshotBoard,
        *,
        poll_s: float = 0.1,
    ) -> None:
        self.slot = slot
        self._outbox = outbox
        self._publisher = publisher
        self._stream_metrics = stream_metrics
        self._snapshots = snapshots
        self._poll_s = poll_s

    def run(self) -> None:
        """The publish thread: until the outbox is closed and empty."""
        while True:
            items = self._outbox.take(PUBLISH_BATCH, timeout=self._poll_s)
            if not items:
                if self._outbox.drained:
                    break
                continue
            self.publish(items)

    def publish(self, items: list[InferredItem]) -> None:
        """Postprocess and publish ``items``, in their order (the publish thread's batch, or a lone
        inference worker's own batch: see :class:`agent.runtime.frames.pipeline.SlotPipeline`)."""
        durable: list[tuple[InferredItem, ResultMessage, float]] = []
        for item in items:
            try:
                message, post_ms = self._result(item)
                if item.work.plan.durable:
                    durable.append((item, message, post_ms))
                    continue
                self._publisher.publish(item.work.plan.topic, message, qos=item.work.plan.qos)
                self._published(item, message, post_ms)
            except Exception:
                self._stream_metrics[item.work.plan.name].dropped["publish_error"].inc()
                log.exception("pipeline.publish.failed", stream=item.work.plan.name)
            item.model.results_pending(-1)
        if durable:
            try:
                self._publish_durable(durable)
            finally:
                for item, _, _ in durable:
                    item.model.results_pending(-1)

    def _publish_durable(self, batch: list[tuple[InferredItem, ResultMessage, float]]) -> None:
        # One spool transaction (one fsync) for the whole batch: durable results at full frame rate
        # cost a fraction of a disk flush each.
        try:
            refused = self._publisher.publish_durable(
                [(i.work.plan.topic, m) for i, m, _ in batch], kind="result"
            )
        except Exception:
            for item, _, _ in batch:
                self._stream_metrics[item.work.plan.name].dropped["publish_error"].inc()
            log.exception("pipeline.publish.failed", streams=sorted({i.work.plan.name for i, _, _ in batch}))
            return
        first_refusal: str | None = None
        for (item, message, post_ms), why in zip(batch, refused, strict=True):
            if why is None:
                self._published(item, message, post_ms)
            else:
                self._stream_metrics[item.work.plan.name].dropped["publish_error"].inc()
                first_refusal = first_refusal or why
        if first_refusal is not None:
            # One line per batch, not per frame (the link counts each as refused_oversize).
            log.error("pipeline.publish.refused", slot=self.slot, error=first_refusal)

    def _result(self, item: InferredItem) -> tuple[ResultMessage, float]:
        """Postprocess ``item`` into its result message; also the postprocess time in ms."""
        work, plan = item.work, item.work.plan
        t0 = time.perf_counter()
        letterbox = in_native_pixels(work.letterbox, work.frame.native_size)
        prediction = item.model.postprocessor(item.outputs, letterbox)
        post_ms = (time.perf_counter() - t0) * 1000.0
        published_at = time.time()
        total_ms = (time.monotonic() - work.frame.captured_mono) * 1000.0
        latency = {
            "preprocess": round(work.pre_ms, 3),
            "queue": round(item.queue_ms, 3),
            "infer": round(item.infer_ms, 3),
            "postprocess": round(post_ms, 3),
            "total": round(total_ms, 3),
        }
        # Validated construction: pydantic-core's validator is faster than model_construct's Python
        # loop, and it checks the message for free.
        message = ResultMessage(
            stream=plan.name,
            frame_index=work.frame.index,
            captured_at=work.frame.captured_at,
            published_at=published_at,
            model=item.model.ref,
            latency_ms=latency,
            classes=prediction.classes,
            detections=prediction.detections,
            tensors=prediction.tensors,
        )
        return message, post_ms

    def _published(self, item: InferredItem, message: ResultMessage, post_ms: float) -> None:
        sm = self._stream_metrics[item.work.plan.name]
        sm.published.inc()
        self._snapshots.published(message)
        item.model.health.published(
            item.work.plan.name, message.classes[0].index if message.classes else None
        )
        sm.postprocess.observe(post_ms / 1000.0)
        sm.queue.observe(item.queue_ms / 1000.0)
        sm.total.observe(message.latency_ms["total"] / 1000.0)
