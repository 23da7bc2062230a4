"""The balancer's aiohttp app stores its state under typed ``web.AppKey`` keys."""

from __future__ import annotations

import warnings

from aiohttp.web import NotAppKeyWarning

from skymesh.balancer.config import parse_config
from skymesh.balancer.server import Balancer, balancer_of, build_app


def test_build_app_raises_no_not_app_key_warning() -> None:
    """aiohttp warns on each string key an app stores; a plain ``app["balancer"]`` did."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", NotAppKeyWarning)
        app = build_app(parse_config({}))
    assert isinstance(balancer_of(app), Balancer)
