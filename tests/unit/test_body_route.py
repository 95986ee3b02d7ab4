"""`BodyRoute`: the generation routes' body and key without FastAPI's generic dependency solving, answering
every request as FastAPI's own route does."""

import fastapi.routing
import pytest
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from pydantic import BaseModel, Field

from llmesh_router.asgi import BodyRoute


class Body(BaseModel):
    prompt: str
    n: int = Field(1, ge=1)


async def key(request: Request) -> str:
    if request.headers.get("authorization") != "Bearer k":
        raise HTTPException(401, "no key")
    return "k"


def app_with(route_class: type[fastapi.routing.APIRoute]) -> FastAPI:
    app, router = FastAPI(), APIRouter(route_class=route_class)

    @router.post("/v1/completions")
    async def completions(body: Body, request: Request, owner: str = Depends(key)) -> JSONResponse:
        return JSONResponse({"prompt": body.prompt, "n": body.n, "owner": owner, "path": request.url.path})

    app.include_router(router)
    return app


REQUESTS = [
    ({"json": {"prompt": "hi", "n": 2}}, 200),
    ({"json": {"prompt": "hi", "n": 0}}, 422),  # invalid
    ({"json": {"n": 2}}, 422),  # a field missing
    ({"json": ["hi"]}, 422),  # not an object
    ({"content": b'{"prompt": "hi",', "headers": {"content-type": "application/json"}}, 422),  # not JSON
    ({"content": b'{"prompt": "hi"}', "headers": {"content-type": "text/plain"}}, 422),  # not said to be JSON
    ({"content": b'{"prompt": "hi"}', "headers": {"content-type": ""}}, 422),
    ({"content": b"", "headers": {"content-type": "application/json"}}, 422),  # no body
    ({"json": {"prompt": "hi"}, "headers": {"authorization": "Bearer x"}}, 401),  # the dependency refuses
    ({"json": {"prompt": 1}, "headers": {"authorization": ""}}, 401),  # the key before the validation
    ({"content": b"{", "headers": {"content-type": "application/json", "authorization": ""}}, 422),  # after JSON
]


@pytest.mark.parametrize(("request_args", "status"), REQUESTS)
def test_every_answer_is_fastapis_own_routes(request_args, status):
    args = {**request_args, "headers": {"authorization": "Bearer k", **request_args.get("headers", {})}}
    fast, generic = (
        TestClient(app_with(cls)).post("/v1/completions", **args) for cls in (BodyRoute, fastapi.routing.APIRoute)
    )
    assert (fast.status_code, fast.json()) == (generic.status_code, generic.json())
    assert fast.status_code == status


def test_a_valid_body_is_served_without_fastapis_dependency_solving(monkeypatch):
    solved = []
    generic_solving = fastapi.routing.solve_dependencies

    async def counted(**kwargs):
        solved.append(kwargs["request"].url.path)
        return await generic_solving(**kwargs)

    monkeypatch.setattr(fastapi.routing, "solve_dependencies", counted)
    client = TestClient(app_with(BodyRoute))
    ok = client.post("/v1/completions", json={"prompt": "hi"}, headers={"authorization": "Bearer k"})
    assert ok.json() == {"prompt": "hi", "n": 1, "owner": "k", "path": "/v1/completions"} and solved == []
    refused = client.post("/v1/completions", json={"prompt": 1}, headers={"authorization": "Bearer k"})
    assert refused.status_code == 422 and solved == ["/v1/completions"]  # (its error: FastAPI's own route)
