"""`GET /v1/models`: every configured model as `BACKEND/MODEL`, then every alias."""

from __future__ import annotations

from common.catalog import BACKENDS, enabled_backends, public_config
from common.settings import Settings
from gateway.protocol import ModelCard, ModelList


def model_list(settings: Settings) -> ModelList:
    data = [ModelCard(id=f"{backend}/{model}", backend=backend, kind=BACKENDS[backend].kind)
            for backend in enabled_backends(settings) for model in settings.backend_models(backend)]
    for alias, target in public_config(settings)["aliases"].items():
        backend = target.split("/", 1)[0]
        data.append(ModelCard(id=alias, backend=backend, kind=BACKENDS[backend].kind,
                              alias_of=target))
    return ModelList(data=data)
