"""A client in its own NATS account drives a real generation: `mesh-actor generate --stream` on client credentials.

The runner publishes the chunks to the client's inbox in the mesh's account and pings it there; they reach
the client in its account through the inbox it exports, and its answers to the pings come back (a missed
ping would stop the generation; 400 tokens take about a second here, a ping goes every 0.5 s). Real nats-server
(embedded by `mesh-actor run`) and llama-server.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tests.harness.generate import QUIET, start_model
from tests.harness.nodes import cli, node, wait_nodes
from tests.llama_harness import require_server
from tests.tiny_models import write_llama

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


async def test_a_client_streams_a_generation_across_the_accounts(tmp_path: Path) -> None:
    require_server()
    model = write_llama(tmp_path / "dense.gguf")
    data_dir = tmp_path / "node"
    async with node(data_dir, "solo", *QUIET):
        await wait_nodes(data_dir, "solo")
        await start_model(data_dir, model)  # an admin's start, on the data dir's own credentials
        creds = tmp_path / "client.json"
        code, _, err = await cli("creds", "issue", "--role", "client", "--data-dir", str(data_dir), "--out", str(creds))
        assert code == 0, err
        user = json.loads(creds.read_text())["user"]
        as_client = ("--nats-creds", str(creds), "--data-dir", str(tmp_path / "elsewhere"))
        # a client user bound to no tenant key generates nothing (issue 30); its key binds it
        code, out, err = await cli("generate", model.name, "hi", "-n", "2", *as_client)
        assert code != 0 and "invalid_api_key" in err + out, err + out
        code, _, err = await cli("keys", "issue", "--tenant", "lab", "--client-user", user, "--rpm", "3",
                                 "--data-dir", str(data_dir))  # fmt: skip
        assert code == 0, err
        async with asyncio.timeout(20):  # the routers' watch of the keys takes a moment
            code, _, err = await cli("generate", model.name, "hi", "-n", "2", *as_client)
            while code != 0 and "invalid_api_key" in err:
                code, _, err = await cli("generate", model.name, "hi", "-n", "2", *as_client)
        assert code == 0, err
        code, out, err = await cli("generate", model.name, "Once upon a time", "-n", "400", "--temperature", "0",
                                   "--stream", *as_client)  # fmt: skip
        assert code == 0, err + out
        streamed = out
        code, out, err = await cli(
            "generate", model.name, "Once upon a time", "-n", "400", "--temperature", "0", "--json", *as_client
        )
        assert code == 0, err + out
        whole = json.loads(out)
        assert whole["tokens_generated"] == 400 or len(whole["tokens"]) == 400, whole
        assert whole["text"] and whole["text"] in streamed  # the streamed chunks are the same text, in order
        # three requests of its key's minute are spent: the fourth is refused, as a front door refuses one
        code, out, err = await cli("generate", model.name, "hi", "-n", "2", *as_client)
        assert code != 0 and "rate_limit_exceeded" in err + out and "rpm" in err + out, err + out
        assert "permissions violation" not in err.lower()
