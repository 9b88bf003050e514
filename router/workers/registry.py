"""Worker registry in Redis: persistent registrations, on top of the workers' leases.

Registration (worker id -> endpoints, kind, block size, CURVE server key) persists in one
hash, so a restarted router resumes ingesting the same workers. Every change gives a
version key a new value after it, so routers re-read the hash only when it changed
(:meth:`WorkerRegistry.version`). The single-writer leases with epoch fencing, and the
routers' heartbeats, are :class:`router.workers.leases.WorkerLeases`, which the registry
extends.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import msgspec

from events.curve import load_public_key
from events.identity import WorkerId
from router.errors import PrefixIndexError
from router.store.connection import RedisClient, gather_bounded, reply_bytes
from router.store.layout import KeyLayout
from router.workers.leases import WorkerLeases
from router.workers.registration import (
    RegistrationConflict,
    RegistrationError,
    RegistrationPolicy,
    check_fields,
    describe,
    differences,
)

__all__ = ["Outcome", "WorkerRecord", "WorkerRegistry", "load_records", "parse_worker_spec"]

log = logging.getLogger(__name__)

Outcome = Literal["created", "replaced", "unchanged"]
"""What :meth:`WorkerRegistry.save` did with a registration."""

_EVENTS_BLOCK_SIZE = "events_block_size"
"""Field of a worker's hash: the block size its events carry when it is not the registered one."""


class WorkerRecord(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How the router reaches one worker.

    NOTE: every instance is valid on its own: ``__post_init__`` runs
    :func:`router.registration.check_fields` whether the record is built, converted or
    decoded from Redis (a failure is a ``RegistrationError``, or a
    ``msgspec.ValidationError`` from a decode), and stores ``http_url`` without path or
    query. What a given router admits is :class:`router.workers.registration.RegistrationPolicy`.

    Attributes:
        worker_id: Unique id within the namespace.
        events_endpoint: ZeroMQ PUB endpoint the router connects to.
        replay_endpoint: ZeroMQ ROUTER replay endpoint, if the worker has one.
        http_url: Base URL of the worker's HTTP API, ``http(s)://host[:port]``
            (``/v1/snapshot`` for kvroute workers).
        kind: ``"kvroute"`` (serves snapshots) or ``"vllm"`` (events only).
        block_size: Tokens per block (1 to :data:`router.workers.registration.MAX_BLOCK_SIZE`).
        topic: ZeroMQ topic prefix to subscribe to.
        server_key: The worker's z85 CURVE server public key (40 characters) when its
            event and replay sockets are CURVE servers; ``None``: plain ZeroMQ.
        served_models: The models the worker serves, when the registration names them
            (``"models"`` in JSON; else the router learns them from the worker's ``GET
            /v1/models``); read them through :attr:`models`.
    """

    worker_id: WorkerId
    events_endpoint: str
    replay_endpoint: str | None = None
    http_url: str | None = None
    kind: Literal["kvroute", "vllm"] = "kvroute"
    block_size: int = 16
    topic: str = ""
    server_key: str | None = None
    # NOTE: UNSET (not named) is left out of the stored JSON, so routers of a release
    # without this field still read every registration that names no models.
    served_models: tuple[str, ...] | msgspec.UnsetType = msgspec.field(
        default=msgspec.UNSET, name="models"
    )

    def __post_init__(self) -> None:
        url = check_fields(
            worker_id=self.worker_id,
            events_endpoint=self.events_endpoint,
            replay_endpoint=self.replay_endpoint,
            http_url=self.http_url,
            block_size=self.block_size,
            topic=self.topic,
            server_key=self.server_key,
            models=self.models,
        )
        if url != self.http_url:
            msgspec.structs.force_setattr(self, "http_url", url)  # path and query stripped
        if self.served_models == ():
            msgspec.structs.force_setattr(self, "served_models", msgspec.UNSET)

    @property
    def models(self) -> tuple[str, ...]:
        """The models the registration names (empty: none named)."""
        return () if self.served_models is msgspec.UNSET else tuple(self.served_models)

    @property
    def has_snapshot(self) -> bool:
        """True when the worker can serve ``GET /v1/snapshot``."""
        return self.kind == "kvroute" and self.http_url is not None


def parse_worker_spec(spec: str) -> WorkerRecord:
    """Parse ``ID=EVENTS_ENDPOINT[,replay=EP][,http=URL][,kind=K][,block_size=N][,topic=T]``.

    A ``server_key=FILE`` option reads the worker's CURVE public key file; ``model=NAME``
    (repeatable) names a model the worker serves.

    Raises:
        PrefixIndexError: The spec is malformed (the message shows the expected shape).
    """
    usage = (
        "expected ID=EVENTS_ENDPOINT[,replay=EP][,http=URL][,kind=vllm][,block_size=N]"
        "[,model=NAME]...[,server_key=FILE]"
    )
    head, _, rest = spec.partition(",")
    worker_id, sep, endpoint = head.partition("=")
    if not sep or not worker_id or not endpoint:
        raise PrefixIndexError(f"worker spec {spec!r}: {usage}")
    fields: dict[str, object] = {"worker_id": worker_id, "events_endpoint": endpoint}
    names = {"replay": "replay_endpoint", "http": "http_url", "kind": "kind", "topic": "topic",
             "server_key": "server_key"}  # fmt: skip
    models: list[str] = []
    for item in filter(None, rest.split(",")):
        name, sep, value = item.partition("=")
        if sep and name == "model":  # repeatable: one per model the worker serves
            models.append(value)
            continue
        if not sep or name not in (*names, "block_size"):
            raise PrefixIndexError(f"worker spec {spec!r}: bad option {item!r}; {usage}")
        fields[names.get(name, name)] = value
    if models:
        fields["models"] = models
    try:
        if "server_key" in fields:
            fields["server_key"] = load_public_key(str(fields["server_key"])).decode()
        return msgspec.convert(fields, WorkerRecord, strict=False)  # block_size is text
    except (msgspec.ValidationError, ValueError, PrefixIndexError) as exc:
        raise PrefixIndexError(f"worker spec {spec!r}: {exc}") from exc


def load_records(path: str | Path) -> list[WorkerRecord]:
    """Worker records from a JSON file holding a list of record objects.

    Raises:
        PrefixIndexError: The file is missing or not a list of valid records.
    """
    try:
        return msgspec.json.decode(Path(path).read_bytes(), type=list[WorkerRecord])
    except (OSError, msgspec.DecodeError, ValueError) as exc:
        raise PrefixIndexError(f"worker config {str(path)!r}: {exc}") from exc


class WorkerRegistry(WorkerLeases):
    """Registrations and leases of a namespace's workers.

    Args:
        client: A connected Redis client.
        layout: Key names of the namespace.
        owner: This router instance's id (random by default).
        lease_ttl_ms: Lease lifetime; renew well within it (e.g. every third).
        policy: What this router admits of the stored registrations (all valid ones by
            default); :meth:`records` skips the others.
        on_invalid: Called once per stored registration skipped (e.g. a counter's ``inc``).
    """

    def __init__(
        self,
        client: RedisClient,
        layout: KeyLayout | None = None,
        *,
        owner: str | None = None,
        lease_ttl_ms: int = 10_000,
        policy: RegistrationPolicy | None = None,
        on_invalid: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(client, layout, owner=owner, lease_ttl_ms=lease_ttl_ms)
        self.policy = policy if policy is not None else RegistrationPolicy()
        self.on_invalid = on_invalid
        # NOTE: worker id -> the stored value last reported invalid (reported once each).
        self._invalid: dict[str, bytes] = {}
        # NOTE: worker id -> (stored value, the policy that admitted it, its record) as
        # of the last records() pass: an unchanged value under the same policy is not
        # decoded and validated again (~0.1 ms a worker; each router replica reads every
        # registration once a second).
        self._seen: dict[WorkerId, tuple[bytes, RegistrationPolicy, WorkerRecord]] = {}

    async def register(self, record: WorkerRecord) -> None:
        """Save a worker's registration, replacing any other under its id."""
        await self.client.hset(self.layout.registry, record.worker_id, msgspec.json.encode(record))
        await self._changed()

    async def create(self, record: WorkerRecord) -> bool:
        """Save a registration unless one exists under its id (atomic); True when saved."""
        encoded = msgspec.json.encode(record)
        created = bool(await self.client.hsetnx(self.layout.registry, record.worker_id, encoded))
        if created:
            await self._changed()
        return created

    async def version(self) -> bytes | None:
        """The registry's version: it changes after every change of a registration made
        through a :class:`WorkerRegistry` (``None``: none since Redis started empty)."""
        raw = await self.client.get(self.layout.registry_version)
        return None if raw is None else reply_bytes(raw)

    async def _changed(self) -> None:
        """Give :meth:`version` a new value (after the change, so a reader that saw the
        new version reads the change). A random one, not a counter: a Redis restarted
        empty and changed as often again would bring a counter back to a value a reader
        has seen."""
        await self.client.set(self.layout.registry_version, uuid.uuid4().hex)

    async def saved(self, worker_id: WorkerId) -> tuple[WorkerRecord | None, str | None]:
        """The registration saved under ``worker_id`` (None: none) and, when what is
        saved there is not a usable record, why (then the record is None)."""
        raw = await self.client.hget(self.layout.registry, worker_id)
        if raw is None:
            return None, None
        try:
            return self._decode(worker_id, reply_bytes(raw)), None
        except RegistrationError as exc:
            return None, str(exc)

    async def check_free(self, record: WorkerRecord) -> None:
        """Refuse ``record`` if another registration is saved under its id.

        Raises:
            RegistrationConflict: Names the fields that differ.
        """
        saved, unusable = await self.saved(record.worker_id)
        if (saved is not None or unusable is not None) and saved != record:
            raise RegistrationConflict(record, saved, unusable)

    async def save(self, record: WorkerRecord, *, replace: bool = False) -> Outcome:
        """Save a registration; another one under its id is replaced only with ``replace``.

        Without ``replace`` the write is create-if-absent (``HSETNX``): of two routers
        registering different workers under one id at once, one gets the conflict.

        Returns:
            ``"created"``, ``"replaced"``, or ``"unchanged"`` (the same one was saved).

        Raises:
            RegistrationConflict: Another registration is saved and ``replace`` is False.
        """
        saved, unusable = await self.saved(record.worker_id)
        if saved == record:
            return "unchanged"
        if saved is None and unusable is None and await self.create(record):
            return "created"
        if not replace:
            await self.check_free(record)  # it may have been saved meanwhile: read again
            return "unchanged"
        await self.register(record)
        why = unusable if saved is None else describe(differences(saved, record))
        log.info("worker %s: registration replaced (%s)", record.worker_id, why)
        return "replaced"

    async def unregister(self, worker_id: WorkerId) -> bool:
        """Remove a registration; True when it existed (its entries go with its lease)."""
        removed = bool(await self.client.hdel(self.layout.registry, worker_id))
        if removed:
            await self._changed()
        return removed

    async def records(self) -> list[WorkerRecord]:
        """Every valid registration that :attr:`policy` admits, sorted by worker id.

        Any other is skipped: one WARNING per stored value names the worker and the
        problem, and ``on_invalid`` is called once (a later pass that meets the same
        value again stays quiet).
        """
        raw = await self.client.hgetall(self.layout.registry)
        out: list[WorkerRecord] = []
        seen, policy = self._seen, self.policy
        self._seen = {}
        for key, value in raw.items():
            worker_id = WorkerId(reply_bytes(key).decode(errors="replace"))
            stored = reply_bytes(value)
            known = seen.get(worker_id)
            if known is not None and known[0] == stored and known[1] is policy:
                record = known[2]  # unchanged: not decoded and validated again
            else:
                try:
                    record = self._decode(worker_id, stored)
                except RegistrationError as exc:
                    self.skip_invalid(worker_id, stored, str(exc))
                    continue
            self._seen[worker_id] = (stored, policy, record)
            out.append(record)
        return sorted(out, key=lambda r: r.worker_id)

    def skip_invalid(self, worker_id: WorkerId, value: bytes, reason: str) -> None:
        """Report a stored registration that cannot be used (once per stored value)."""
        if self._invalid.get(worker_id) == value:
            return
        self._invalid[worker_id] = value
        log.warning(
            "skipping the registration of worker %r stored in Redis: %s; replace it with "
            "PUT /v1/workers/%s or remove it with `kvroute index unregister %s`",
            worker_id, reason, worker_id, worker_id,
        )  # fmt: skip
        if self.on_invalid is not None:
            self.on_invalid()

    def _decode(self, worker_id: WorkerId, value: bytes) -> WorkerRecord:
        try:
            record = msgspec.json.decode(value, type=WorkerRecord)
        except msgspec.DecodeError as exc:  # ValidationError included
            raise RegistrationError(str(exc)) from None
        if record.worker_id != worker_id:
            raise RegistrationError(f"it names another worker id, {record.worker_id!r}")
        self.policy.check(record)
        return record

    async def flag_block_size(self, worker_id: WorkerId, events_block_size: int | None) -> None:
        """Record that the worker's events carry ``events_block_size``, not its registered
        block size (``None``: they agree, or nothing says otherwise; the flag is dropped)."""
        key = self.layout.worker(worker_id)
        if events_block_size is None:
            await self.client.hdel(key, _EVENTS_BLOCK_SIZE)
        else:
            await self.client.hset(key, _EVENTS_BLOCK_SIZE, events_block_size)

    async def events_block_sizes(self, worker_ids: Sequence[WorkerId]) -> dict[WorkerId, int]:
        """The flagged workers among ``worker_ids``: id -> the block size their events carry
        (see :meth:`flag_block_size`)."""
        values = await gather_bounded(
            self.client.hget(self.layout.worker(WorkerId(w)), _EVENTS_BLOCK_SIZE)
            for w in worker_ids
        )
        return {w: int(v) for w, v in zip(worker_ids, values, strict=True) if v is not None}
