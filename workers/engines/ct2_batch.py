"""Cross-request batching for faster-whisper without re-implementing its decoding.

Each clip of a batch runs faster-whisper's own `transcribe` in a thread of its own, against a
stand-in for the CTranslate2 model. The stand-in holds every `generate` call until each live
clip has made one (or finished), then sends the calls that can share one (same options, so
same kwargs) to CTranslate2 as one batched call: the mel windows stacked (every window is
padded to 30 s, so nothing is padded across clips) and encoded inside `generate`. Seeking,
prompts, temperature fallback and segment splitting stay faster-whisper's, so each clip's
text is what it is unbatched. `encode` only defers; a call that needs the encoder output
itself (language detection, word alignment) encodes that clip alone.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")


@dataclass(slots=True)
class _Deferred:
    """A window's mel features whose encoding waits for the batch's `generate`."""

    features: np.ndarray  # [1, n_mels, frames]
    to_cpu: bool
    encoded: Any = None


@dataclass(slots=True)
class _Call:
    key: str
    features: np.ndarray
    prompts: list[list[int]]
    kwargs: dict[str, Any]
    done: bool = False
    result: Any = None
    error: BaseException | None = None


class _Coalescer:
    """Stands in for a `ctranslate2.models.Whisper` shared by `parties` threads."""

    def __init__(self, model: Any, parties: int, start_token: int) -> None:
        self._model = model
        self._start = start_token
        self._live = parties
        self._waiting: list[_Call] = []
        self._cond = threading.Condition()
        self.calls = 0  # batched generate calls made (for tests and the bench)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def leave(self) -> None:
        """A clip's thread is done: the others no longer wait for it."""
        with self._cond:
            self._live -= 1
            if self._waiting and len(self._waiting) >= self._live:
                self._flush()

    def encode(self, features: Any, to_cpu: bool = False) -> _Deferred:
        return _Deferred(np.asarray(features), to_cpu)

    def _encoded(self, value: Any) -> Any:
        if isinstance(value, _Deferred):
            if value.encoded is None:
                import ctranslate2

                value.encoded = self._model.encode(
                    ctranslate2.StorageView.from_array(value.features), to_cpu=value.to_cpu)
            return value.encoded
        return value

    def detect_language(self, features: Any, *args: Any, **kwargs: Any) -> Any:
        return self._model.detect_language(self._encoded(features), *args, **kwargs)

    def align(self, features: Any, *args: Any, **kwargs: Any) -> Any:
        return self._model.align(self._encoded(features), *args, **kwargs)

    def generate(self, features: Any, prompts: list[list[int]], **kwargs: Any) -> Any:
        if not isinstance(features, _Deferred) or features.encoded is not None:
            return self._model.generate(self._encoded(features), prompts, **kwargs)
        # CTranslate2 batches only prompts whose start-of-transcript token is at one position
        # (previous-text conditioning varies it): those calls share a batch
        at = [prompt.index(self._start) if self._start in prompt else -1 for prompt in prompts]
        call = _Call(repr((at, sorted(kwargs.items()))), features.features, prompts, kwargs)
        with self._cond:
            self._waiting.append(call)
            if len(self._waiting) >= self._live:
                self._flush()
            self._cond.wait_for(lambda: call.done)
        if call.error is not None:
            raise call.error
        return call.result

    def _flush(self) -> None:
        """Every live thread waits in `generate` (lock held): one CTranslate2 call per set of
        equal options, then wake them all."""
        import ctranslate2

        groups: dict[str, list[_Call]] = {}
        for call in self._waiting:
            groups.setdefault(call.key, []).append(call)
        self._waiting = []
        for calls in groups.values():
            try:
                mels = ctranslate2.StorageView.from_array(
                    np.ascontiguousarray(np.concatenate([c.features for c in calls])))
                prompts = [prompt for c in calls for prompt in c.prompts]
                results = self._model.generate(mels, prompts, **calls[0].kwargs)
                self.calls += 1
                at = 0
                for c in calls:
                    c.result, at = results[at:at + len(c.prompts)], at + len(c.prompts)
            except Exception as exc:  # every clip of this call sees it
                for c in calls:
                    c.error = exc
            for c in calls:
                c.done = True
        self._cond.notify_all()


def run_batched(handle: Any, jobs: list[Callable[[Any], T]]) -> list[T | Exception]:
    """Run each job (given a WhisperModel whose CTranslate2 model is the shared stand-in) in
    its own thread; what each returned, or the exception it raised."""
    start = handle.hf_tokenizer.token_to_id("<|startoftranscript|>")
    coalescer = _Coalescer(handle.model, len(jobs), start)
    shadow = copy.copy(handle)  # the same weights, tokenizer and feature extractor
    shadow.model = coalescer

    def run(job: Callable[[Any], T]) -> T | Exception:
        try:
            return job(shadow)
        except Exception as exc:
            return exc
        finally:
            coalescer.leave()

    with ThreadPoolExecutor(len(jobs), thread_name_prefix="batch") as pool:
        return list(pool.map(run, jobs))
