"""The smallest Python processor: every hook continues (the benchmark's Python guest)."""

import wit_world
from wit_world.imports import types


class WitWorld(wit_world.WitWorld):
    def on_request(self, req: types.Request) -> types.Action:
        return types.Action_Continue()

    def on_response(self, resp: types.Response) -> types.Action:
        return types.Action_Continue()

    def on_chunk(self, index: int, text: str) -> types.Action:
        return types.Action_Continue()

    def on_stream_end(self) -> types.Action:
        return types.Action_Continue()
