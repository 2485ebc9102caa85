"""An API view whose work found the history's database away (a profile saved as it stops, say):
a 503 in the API's error shape, said once in the log. The pages' side, on a real PostgreSQL that
stops: tests/browser/test_history_outage.py."""
from __future__ import annotations

import json

from django.db import OperationalError
from django.test import RequestFactory

from engines.history.outage import HistoryOutage
from engines.views import api as api_module
from engines.views.api import api_view


async def test_an_api_view_that_finds_the_database_away_answers_503_in_the_error_shape(caplog, monkeypatch) -> None:
    """The API's shape and status, the driver's first line only, said once in the log, no traceback."""
    monkeypatch.setattr(api_module, "history_outage", HistoryOutage())  # this test's outage only

    @api_view("POST")
    async def saving(request: object) -> None:
        raise OperationalError('connection failed: connection to server at "127.0.0.1", port 5 failed: '
                               "Connection refused\n\tIs the server running on that host?")

    for _ in range(2):
        response = await saving(RequestFactory().post("/debug/profile_stop"))
        assert response.status_code == 503 and response["Content-Type"] == "application/json"
        error = json.loads(response.content)
        assert error["code"] == 503 and error["error"]["message"] == error["message"] == (
            'The history database does not answer: connection failed: connection to server at "127.0.0.1", port 5 '
            "failed: Connection refused. Try again when it is back.")
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["history: the database does not answer"]
    assert not any(record.exc_info for record in caplog.records)
