"""Every Redis key and stream name the service uses. Nothing else builds key strings."""

import hashlib

from common.schemas import BATCH, INTERACTIVE, LANES  # noqa: F401  (the lanes' spelling, re-exported for the store)

PREFIX = "sg:"
WORKER_GROUP = "workers"
#: stands for the backend in a key template: a Lua script that learns the backend from a
#: task's hash fills it in (common/store/poll.py), so the key layout stays here
BACKEND_SLOT = "<backend>"

def task(task_id: str) -> str:
    """Hash: one task's record (state, params, attempt, result, error …)."""
    return f"{PREFIX}task:{task_id}"


def task_id_of(task_key: str) -> str:
    """The task id in `task`'s key."""
    return task_key.removeprefix(f"{PREFIX}task:")


def task_pattern() -> str:
    return f"{PREFIX}task:*"


def queue(backend: str, lane: str = BATCH) -> str:
    """Stream of task ids for one backend and lane, consumed by the group WORKER_GROUP. The
    batch lane keeps the name the single queue had, so entries queued before lanes still run."""
    return f"{PREFIX}queue:{backend}" + ("" if lane == BATCH else f":{lane}")


def queue_counter(backend: str, lane: str = BATCH) -> str:
    """Integer: how many entries were ever added to the lane's stream (each entry's number)."""
    return f"{PREFIX}queue-seq:{backend}" + ("" if lane == BATCH else f":{lane}")


def lane_share(backend: str, lane: str, owner: str) -> str:
    """Integer: how many of an owner's entries wait in the lane's stream, not yet read
    (counted when one is added, uncounted when a worker reads it, or it starts or ends: its
    `share` field names this key). At SPEECH_QUEUED_PER_KEY, the owner's next tasks wait in
    `held` instead. Beside it, this key + ":work" (float): their work (SPEECH_QUEUED_SECONDS_
    PER_KEY bounds it; shares.py's Lua names it so, from this key)."""
    return f"{PREFIX}lane-share:{backend}:{lane}:{owner}"


def held(backend: str, lane: str, owner: str) -> str:
    """List of task keys: an owner's tasks not yet in the lane's stream, oldest first (its
    `lane_share` is full); the first enters the stream when one of the owner's entries there
    is read, starts or ends (its `held` field names this key while it waits here)."""
    return f"{PREFIX}held:{backend}:{lane}:{owner}"


def lines(backend: str) -> str:
    """List of task keys: every task waiting in any owner's `held` line of the backend (both
    lanes), for an autoscaler to count with the streams' lag (deploy/k8s: KEDA's redis list
    trigger), since they have no stream entry yet."""
    return f"{PREFIX}lines:{backend}"


def idempotency(owner: str, key: str) -> str:
    """String: the task id a submit with this owner's Idempotency-Key created."""
    digest = hashlib.sha256(key.encode()).hexdigest()[:32]
    return f"{PREFIX}idem:{owner or '-'}:{digest}"


def dead_letter(backend: str) -> str:
    """Stream of tasks that exhausted their deliveries."""
    return f"{PREFIX}dead:{backend}"


def input_blob(task_id: str) -> str:
    return f"{PREFIX}blob:{task_id}:input"


def staged_input(stage_id: str) -> str:
    """An upload written while its probe runs; the submit renames it to its task's input."""
    return f"{PREFIX}blob:staged:{stage_id}"


def output_blob(task_id: str) -> str:
    return f"{PREFIX}blob:{task_id}:output"


def speech_chunks(task_id: str) -> str:
    """Stream: a TTS task's audio so far, one entry per spoken piece (entry id 0-N for the
    N-th piece, from 1), appended by the task's current attempt only."""
    return f"{PREFIX}speech:{task_id}"


def events(task_id: str) -> str:
    """Pub/sub channel: segments as they are produced, then the terminal state."""
    return f"{PREFIX}events:{task_id}"


def heartbeat(backend: str, consumer: str) -> str:
    """String with a TTL: a live worker's /health snapshot."""
    return f"{PREFIX}heartbeat:{backend}:{consumer}"


def live(backend: str) -> str:
    """Sorted set: consumer -> when its heartbeat expires (ms, Redis's clock), so finding a
    backend's live workers (or counting them: one ZCOUNT) needs no scan of the keyspace."""
    return f"{PREFIX}live:{backend}"


def breaker(backend: str, model: str) -> str:
    """Hash: one model's load failures, the source they were for, its state (open, when it
    half-opens, trips so far) and the probe let through (holder, until when)."""
    return f"{PREFIX}breaker:{backend}:{model}"


def no_worker_since(backend: str) -> str:
    """String: when a sweeping gateway first saw the backend without a live worker."""
    return f"{PREFIX}no-worker:{backend}"


def counters(backend: str) -> str:
    """Hash: per-backend counters (tasks by outcome, load failures, worker starts)."""
    return f"{PREFIX}stats:{backend}"


def histogram(backend: str, metric: str) -> str:
    """Hash: one latency histogram's cumulative buckets, sum and count."""
    return f"{PREFIX}hist:{backend}:{metric}"


def devices() -> str:
    """Set: every device id a worker registered with the memory broker."""
    return f"{PREFIX}devices"


def device(device_id: str) -> str:
    """Hash: one device's memory budget (MiB) and its evictions so far."""
    return f"{PREFIX}device:{device_id}"


def device_holders(device_id: str) -> str:
    """Hash: consumer -> JSON reservation (backend, model, mib, busy, evict, last_used,
    expires): who holds how much of the device's budget, until when unless renewed."""
    return f"{PREFIX}device:{device_id}:holders"


def device_waiting(device_id: str) -> str:
    """Hash: consumer -> JSON waiting load (backend, model, need, since, expires): loads in
    line for the device, first come first served by `since`."""
    return f"{PREFIX}device:{device_id}:waiting"


def model_peaks() -> str:
    """Hash: "backend/model" -> the MiB its last measured load and first task peaked at."""
    return f"{PREFIX}model-peaks"


def backlog(backend: str) -> str:
    """Hash: the backend's queued work per lane ("<lane>:tasks", "<lane>:seconds" of audio)
    and its running work ("running:tasks", "running:seconds"), and the same audio-seconds per
    model ("<lane>:seconds:<model>", "running:seconds:<model>"), kept by the task scripts."""
    return f"{PREFIX}backlog:{backend}"


def rate(backend: str) -> str:
    """Hash: the backend's measured processing rate (audio-seconds per wall second, a moving
    average of finished tasks) and how many tasks it averages, for all its models together
    ("rate", "tasks") and per model ("rate:<model>", "tasks:<model>")."""
    return f"{PREFIX}rate:{backend}"


def deadlines(backend: str) -> str:
    """Sorted set: task ids of queued tasks with a deadline, scored by it (the sweeper's)."""
    return f"{PREFIX}deadlines:{backend}"


def usage(owner: str, period: str) -> str:
    """Hash: an owner's usage in one UTC period ("day:2025-06-01", "month:2025-06"), per unit
    ("audio_seconds") and per unit and backend ("audio_seconds:faster-whisper"): charged at
    submit, given back when the task fails or is cancelled; it expires a day past its period."""
    return f"{PREFIX}usage:{owner or '-'}:{period}"


def in_flight(owner: str) -> str:
    """String: how many of an owner's tasks are queued or running (counted by the submit,
    uncounted by the terminal write: its `in_flight` field names this key)."""
    return f"{PREFIX}in-flight:{owner or '-'}"


def input_bytes(owner: str) -> str:
    """String: the bytes of input (uploads, reference clips) an owner's unfinished tasks
    hold in Redis or SPEECH_BLOB_DIR (counted by the submit, uncounted by the terminal write:
    its `input_bytes_key` field names this key)."""
    return f"{PREFIX}input-bytes:{owner or '-'}"


def submits(owner: str) -> str:
    """Integer with a TTL: how many tasks an owner submitted in the minute that began with
    the first of them (SPEECH_SUBMITS_PER_MINUTE_PER_KEY bounds it)."""
    return f"{PREFIX}submits:{owner or '-'}"


def slots(kind: str, owner: str) -> str:
    """Sorted set: the holders of an owner's leased slots of one kind ("sessions": live
    sessions, "webhooks": deliveries on the way), scored by when each lease ends (epoch s);
    common/store/slots.py."""
    return f"{PREFIX}slots:{kind}:{owner or '-'}"


def usage_total(owner: str) -> str:
    """Hash: an owner's all-time usage of SUCCEEDED tasks, "<unit>:<backend>" -> amount (what
    the per-key Prometheus counters report)."""
    return f"{PREFIX}usage-total:{owner or '-'}"


def session_billed(meter: str) -> str:
    """String with a TTL: the seconds of one live session's audio charged outside any task
    so far (its meter's id: gateway/realtime/metering.py), so a charge sent again after its
    reply was lost charges only what it adds."""
    return f"{PREFIX}session-billed:{meter}"


def webhooks_due() -> str:
    """Sorted set: ids of finished tasks whose webhook is owed, scored by when the next
    attempt is due (epoch ms); a claimed entry is scored at the end of its claim."""
    return f"{PREFIX}webhooks:due"


def webhook_attempts(task_id: str) -> str:
    """List: one JSON record per webhook delivery attempt of a task (kept as long as it)."""
    return f"{PREFIX}webhooks:attempts:{task_id}"


def webhook_redeliveries(owner: str) -> str:
    """String: an owner's redeliver calls in the current minute (it expires with it)."""
    return f"{PREFIX}webhooks:redeliveries:{owner or '-'}"


def webhook_counters() -> str:
    """Hash: webhook delivery attempts by outcome (delivered, failed, gave_up)."""
    return f"{PREFIX}webhooks:stats"


def refusal(token: str) -> str:
    """String with a TTL (the retention): why a Sage submit was refused, under the random
    part of its refusal id (gateway/errors.py, SAGE_SUBMIT_ROUTES)."""
    return f"{PREFIX}refusal:{token}"


def refusals_kept(owner: str) -> str:
    """Integer: how many refusal reasons (`refusal`) an owner's refused submits have kept in
    the current retention window (it expires with the window; past
    refusals.MAX_KEPT_PER_OWNER none is kept until it does)."""
    return f"{PREFIX}refusals-kept:{owner or '-'}"


def client_secret(digest: str) -> str:
    """String with a TTL (its lifetime): an ephemeral realtime key's owner and session, JSON,
    under the SHA-256 of the key (the key itself is never stored)."""
    return f"{PREFIX}client-secret:{digest}"


def voice_consent(owner: str, consent_id: str) -> str:
    """String (JSON), no TTL: one consent recording's record (name, language, transcript,
    audit)."""
    return f"{PREFIX}consent:{owner or '-'}:{consent_id}"


def voice_consents(owner: str) -> str:
    """Sorted set, no TTL: an owner's consent ids, scored by creation (ms)."""
    return f"{PREFIX}consents:{owner or '-'}"


def custom_voice(owner: str, voice_id: str) -> str:
    """String (JSON), no TTL: one custom voice's record (name, consent, voiceprint score …)."""
    return f"{PREFIX}voice:{owner or '-'}:{voice_id}"


def custom_voices(owner: str) -> str:
    """Sorted set, no TTL: an owner's voice ids, scored by creation (ms)."""
    return f"{PREFIX}voices:{owner or '-'}"


def consents_withdrawn() -> str:
    """Sorted set, no TTL: consents being withdrawn (their record, then their voices, in
    several calls), scored by when (s); members JSON [owner, consent id]: the sweeper deletes
    the voices a withdrawal cut short left behind."""
    return f"{PREFIX}consents-withdrawn"


def voice_files() -> str:
    """Sorted set, no TTL: voice audio files between their write and their record's create
    (or between a record's delete and the file's), scored by when (s); members JSON [file
    name, [the record keys that may name it]]: the sweeper removes a file no record names."""
    return f"{PREFIX}voice-files"


def voice_audio(owner: str, object_id: str) -> str:
    """String, no TTL: a consent recording's or voice sample's audio (when not in the blob
    directory)."""
    return f"{PREFIX}voice-audio:{owner or '-'}:{object_id}"
