"""`GET /v1/models`: every configured model as `BACKEND/MODEL`, then every alias;
`GET /v1/models/{model}`: one of them."""

from __future__ import annotations

from common.catalog import BACKENDS, enabled_backends, public_config
from common.settings import Settings
from gateway.errors import RequestError
from gateway.protocol import ModelCard, ModelList


def model_list(settings: Settings) -> ModelList:
    data = [ModelCard(id=f"{backend}/{model}", backend=backend, kind=BACKENDS[backend].kind)
            for backend in enabled_backends(settings) for model in settings.backend_models(backend)]
    for alias, target in public_config(settings)["aliases"].items():
        backend = target.split("/", 1)[0]
        data.append(ModelCard(id=alias, backend=backend, kind=BACKENDS[backend].kind,
                              alias_of=target))
    return ModelList(data=data)


def model_card(settings: Settings, model: str) -> ModelCard:
    """The card `model_list` lists under the id `model`; a 404 if it lists none."""
    for card in model_list(settings).data:
        if card.id == model:
            return card
    shown = model if len(model) <= 40 else model[:40] + "…"
    raise RequestError(404, f"unknown model {shown!r}; GET /v1/models lists them",
                       param="model", code="model_not_found")
