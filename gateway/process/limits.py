"""Request body limits of the gateway: size and time (the middleware lives in common/, the
worker's own HTTP server applies the same one)."""

from common.body_limit import BodyLimitMiddleware, BodyRefused, BodyTimeout, BodyTooLarge

__all__ = ["BodyLimitMiddleware", "BodyRefused", "BodyTimeout", "BodyTooLarge"]
