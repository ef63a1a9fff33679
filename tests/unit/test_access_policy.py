"""AccessPolicy (frontends/common/access.py): the token checks the gRPC interceptor and the HTTP
JSON mirror share. Pure logic: no server, no engine."""
from __future__ import annotations

import pytest

from frontends.common.access import ADMIN_METHODS, HEALTH_SERVICE, AccessPolicy
from jax_engine.errors import PermissionDenied, Unauthenticated

GENERATE = "/sglang.grpc.scheduler.SglangScheduler/Generate"
ADMIN = "/allspark.allspark_service.AllSpark/StartModel"
HEALTH = f"/{HEALTH_SERVICE}/Check"


def test_the_admin_set_is_allspark_life_cycle_and_file_reading():
    assert ADMIN in ADMIN_METHODS and "/allspark.allspark_service.AllSpark/GetFileInformation" in ADMIN_METHODS
    assert not any(m.endswith(("/StartRequest", "/Get")) for m in ADMIN_METHODS)


def test_open_policy_allows_everything_but_admin():
    policy = AccessPolicy()
    assert policy.check(GENERATE, None) is None
    assert policy.check(GENERATE, "Bearer anything") is None
    err = policy.check(ADMIN, None)
    assert isinstance(err, PermissionDenied) and "--enable-admin" in str(err)
    assert AccessPolicy(enable_admin=True).check(ADMIN, None) is None


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer ", "Bearer wrong", "Basic k", "k", "Bearer k2"])
def test_api_key_refuses_missing_or_wrong_tokens(header):
    err = AccessPolicy(api_key="k").check(GENERATE, header)
    assert isinstance(err, Unauthenticated) and "API key" in str(err)


@pytest.mark.parametrize("header", ["Bearer k", "bearer k", "BEARER   k  ", " Bearer k"])
def test_api_key_accepts_the_bearer_token_in_any_case(header):
    assert AccessPolicy(api_key="k").check(GENERATE, header) is None


def test_health_is_open_whatever_the_keys():
    policy = AccessPolicy(api_key="k", admin_api_key="a")
    assert policy.check(HEALTH, None) is None and policy.check(f"/{HEALTH_SERVICE}/Watch", "Bearer x") is None


def test_admin_key_rules():
    policy = AccessPolicy(api_key="k", admin_api_key="a", enable_admin=True)
    assert policy.check(ADMIN, "Bearer a") is None
    assert isinstance(policy.check(ADMIN, "Bearer k"), PermissionDenied)      # the user key is not enough
    assert isinstance(policy.check(ADMIN, None), Unauthenticated)
    assert isinstance(policy.check(ADMIN, "Bearer x"), Unauthenticated)
    assert policy.check(GENERATE, "Bearer a") is None                         # the admin key opens the rest too
    assert policy.check(GENERATE, "Bearer k") is None
    # admin disabled: refused even with the admin key
    assert isinstance(AccessPolicy(admin_api_key="a").check(ADMIN, "Bearer a"), PermissionDenied)
    # admin key only: ordinary methods stay open, admin methods need it
    only_admin = AccessPolicy(admin_api_key="a", enable_admin=True)
    assert only_admin.check(GENERATE, None) is None
    assert isinstance(only_admin.check(ADMIN, None), Unauthenticated)
