"""What makes a server one replica among several on a shared catalog and KV tier.

- `LeaseKeeper`: renews the leases of the ingests this process owns (its own thread, so a
  slow catalog poll never lets a live ingest's lease lapse).
- `IndexFollower`: brings the local vector index up to the catalog's change log
  (`changes_since(cursor)`): adds and deletes made by any replica become searchable here
  within one poll interval, without a restart.
- `reclaim_expired`: deletes documents whose ingest lease expired (their owner died),
  whichever replica notices first; live ingests of peers are never touched.
- `ReplicaDaemon`: one background thread running the follower, the reclaimer and the
  store's orphan-KV sweep on their intervals.

The same runs on a single node with SQLite: a `kvmosaic ingest` next to a running server
then becomes searchable in it too.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import numpy.typing as npt

from app.catalog import ADD, Catalog, IndexChangeRecord, IndexedChunk
from app.catalog.models import utcnow
from retrieval.embedder import Embedder
from retrieval.retriever import IndexUpdate, Retriever

log = logging.getLogger(__name__)

# History the change log keeps; a replica that could not poll for half of it resyncs.
CHANGE_LOG_KEEP_S = 24 * 3600.0


def new_replica_id() -> str:
    """host:pid:random — unique per process, readable in logs and in the `ingests` table."""
    return f"{socket.gethostname()[:64]}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def stored_vector(chunk: IndexedChunk, embedder: Embedder) -> npt.NDArray[np.float32] | None:
    """The chunk's stored embedding if this replica's embedder made it; None: embed the text."""
    if (
        chunk.embedding is None
        or chunk.embedder != embedder.name
        or len(chunk.embedding) != 4 * embedder.dim
    ):
        return None
    return np.frombuffer(chunk.embedding, dtype="<f4").astype(np.float32)


def index_rows(
    catalog: Catalog, embedder: Embedder
) -> Iterator[tuple[int, str, npt.NDArray[np.float32] | None]]:
    """(chunk id, embedding text, stored vector or None) of every retrievable chunk."""
    for chunk in catalog.iter_indexed_chunks():
        yield chunk.chunk_id, chunk.embedding_text, stored_vector(chunk, embedder)


class LeaseKeeper:
    """Holds this process's ingest leases: `hold` when an ingest begins, `release` when it
    ends; a thread renews every held lease each `lease_s / 3` seconds."""

    def __init__(self, catalog: Catalog, owner: str, lease_s: float):
        self.catalog, self.owner, self.lease_s = catalog, owner, lease_s
        self._held: set[int] = set()
        self._lock = threading.Lock()
        # taken by a renewal and by an ingest's commit, so that neither sees the other halfway
        self._renewing = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ingest-leases", daemon=True)
        self._thread.start()

    def hold(self, document_id: int) -> None:
        with self._lock:
            self._held.add(document_id)

    def release(self, document_id: int) -> None:
        with self._lock:
            self._held.discard(document_id)

    @contextmanager
    def committing(self, document_id: int) -> Iterator[None]:
        """Hold while the ingest of `document_id` commits (`Catalog.finish_ingest` deletes its
        lease row); once the block succeeds the lease is released. A renewal waits for the
        commit, so it never finds the row of an ingest that finished gone while it is still held
        (the ingest goes on to update the index and save it before its own `release`)."""
        with self._renewing:
            yield
            self.release(document_id)

    def renew(self) -> set[int]:
        """Renew now; returns the ids whose lease was lost (reclaimed or deleted meanwhile)."""
        with self._renewing:
            with self._lock:
                held = set(self._held)
            kept = self.catalog.heartbeat(sorted(held), self.owner, self.lease_s)
            with self._lock:
                # An ingest released while the heartbeat ran (one that failed, or finished
                # without `committing`) lost nothing. Only ids still held were.
                lost = (held - kept) & self._held
        for document_id in lost:
            log.warning(
                "the ingest lease of document %d was lost; its ingest will fail", document_id
            )
        return lost

    def _run(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                self.renew()
            except Exception:  # the catalog may be briefly unreachable: try again next beat
                log.exception("renewing ingest leases failed")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


class IndexFollower:
    """Applies the catalog's change log to the local index, from `retriever.cursor` on.

    The log keeps `CHANGE_LOG_KEEP_S` of history (`prune`); a follower that has not polled
    successfully for half of that may have missed pruned entries, so it resyncs instead:
    the index is compared with the catalog's retrievable chunks and the difference applied.
    """

    def __init__(self, catalog: Catalog, retriever: Retriever, page: int = 1000):
        self.catalog, self.retriever, self.page = catalog, retriever, page
        self._last_poll = time.monotonic()

    def poll(self) -> int:
        """Apply every change committed since the cursor (or resync after a long gap);
        returns how many changes were applied."""
        if time.monotonic() - self._last_poll > CHANGE_LOG_KEEP_S / 2:
            applied = self.resync()
        else:
            applied = self._follow()
        self._last_poll = time.monotonic()
        return applied

    def resync(self) -> int:
        """Bring the index to exactly the catalog's retrievable chunks; returns rows changed."""
        # no delete between reading the catalog and changing the index
        with self.retriever.updating():
            cursor = self.catalog.last_change_seq()  # first, as at start-up
            wanted, held = set(self.catalog.indexed_chunk_ids()), set(self.retriever.index.ids())
            self.retriever.remove(sorted(held - wanted))
            added = self.catalog.indexed_chunks_by_id(sorted(wanted - held))
            if added:
                stored = [stored_vector(c, self.retriever.embedder) for c in added]
                missing = [i for i, v in enumerate(stored) if v is None]
                fresh = iter(self.retriever.embed([added[i].embedding_text for i in missing]))
                vectors = [v if v is not None else next(fresh) for v in stored]
                self.retriever.add([c.chunk_id for c in added], np.stack(vectors))
            self.retriever.cursor = max(self.retriever.cursor, cursor)
            log.warning(
                "vector index resynced with the catalog: %d rows removed, %d added",
                len(held - wanted),
                len(added),
            )
            return len(held - wanted) + len(added)

    def prune(self) -> int:
        """Drop change log entries older than `CHANGE_LOG_KEEP_S` (any replica may do it)."""
        return self.catalog.prune_changes(utcnow() - timedelta(seconds=CHANGE_LOG_KEEP_S))

    def _follow(self) -> int:
        applied = 0
        while True:
            with self.retriever.updating():  # a page is read and applied with no delete in between
                changes = self.catalog.changes_since(self.retriever.cursor, self.page)
                if not changes:
                    return applied
                applied += self.retriever.apply(self._updates(changes))
            if len(changes) < self.page:
                return applied

    def _updates(self, changes: Sequence[IndexChangeRecord]) -> list[IndexUpdate]:
        adds = [c.chunk for c in changes if c.op == ADD and c.chunk is not None]
        vectors = {c.chunk_id: stored_vector(c, self.retriever.embedder) for c in adds}
        unembedded = [c for c in adds if vectors[c.chunk_id] is None]
        if unembedded:  # made by another embedder: embed the text with ours
            fresh = self.retriever.embed([c.embedding_text for c in unembedded])
            vectors.update({c.chunk_id: v for c, v in zip(unembedded, fresh)})
        # an add whose chunk is gone is applied as a removal (a later `remove` follows anyway)
        return [
            IndexUpdate(c.seq, c.chunk_id, vectors.get(c.chunk_id) if c.op == ADD else None)
            for c in changes
        ]


def reclaim_expired(
    catalog: Catalog, forget_document: Callable[[int], object], owner: str, lease_s: float
) -> int:
    """Delete the documents whose ingest lease expired (claimed first, so one replica does
    it); returns how many were deleted. `forget_document` deletes catalog rows, then KV."""
    removed = 0
    for ingest in catalog.expired_ingests():
        if not catalog.claim_ingest(ingest.document_id, owner, lease_s):
            continue  # renewed, finished or claimed by a peer meanwhile
        log.warning(
            "removing half-ingested document %d: its ingest by %s stopped renewing its lease at %s",
            ingest.document_id,
            ingest.owner,
            ingest.lease_expires_at.isoformat(),
        )
        removed += forget_document(ingest.document_id) is not None
    return removed


@dataclass
class PeriodicJob:
    name: str
    every_s: float
    run: Callable[[], object]
    due: float = 0.0


class ReplicaDaemon:
    """Runs each job every `every_s` seconds on one background thread; a failing job is
    logged and retried at its next turn. Jobs with `every_s` <= 0 are left out."""

    def __init__(self, jobs: list[PeriodicJob]):
        self.jobs = [j for j in jobs if j.every_s > 0]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="replica", daemon=True)

    def start(self) -> ReplicaDaemon:
        now = time.monotonic()
        for job in self.jobs:
            job.due = now + job.every_s
        if self.jobs:
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            for job in self.jobs:
                if now >= job.due and not self._stop.is_set():
                    self._run_one(job)
                    job.due = time.monotonic() + job.every_s
            self._stop.wait(max(0.0, min(j.due for j in self.jobs) - time.monotonic()))

    @staticmethod
    def _run_one(job: PeriodicJob) -> None:
        try:
            job.run()
        except Exception:  # e.g. the catalog is briefly unreachable: the next turn retries
            log.exception("replica job %s failed", job.name)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
