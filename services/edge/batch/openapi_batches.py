"""The OpenAPI paths and schemas of the Files and Batch APIs (services/edge/batch/files_api.py, batches_api.py), for
services/edge/surfaces/openapi.py's document: the same rules the handlers enforce."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from services.edge.batch import batches_api, files_api

JSON = "application/json"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def paths(security: dict[str, Any], auth_errors: tuple[int, ...],
          errors: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    def answer(description: str, schema: str, *codes: int) -> dict[str, Any]:
        return {"200": {"description": description, "content": {JSON: {"schema": _ref(schema)}}},
                **errors(*auth_errors, *codes, 500, 503)}

    file_id = [{"name": "file_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    batch_id = [{"name": "batch_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    page = [{"name": "limit", "in": "query", "required": False,
             "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
            {"name": "after", "in": "query", "required": False, "schema": {"type": "string"}}]
    upload = {"required": True, "content": {"multipart/form-data": {"schema": {
        "type": "object", "required": ["file", "purpose"],
        "properties": {"file": {"type": "string", "format": "binary",
                                "description": f"JSONL, one request per line; at most {files_api.MAX_UPLOAD_BYTES} "
                                               "bytes"},
                       "purpose": {"type": "string", "enum": list(files_api.PURPOSES)}}}}}}
    return {
        "/v1/files": {
            "post": {"summary": "upload a batch input file", **security, "requestBody": upload,
                     "responses": answer("the file", "File", 400, 408, 413)},
            "get": {"summary": "the caller's files", **security, "responses": answer("files", "FileList")}},
        "/v1/files/{file_id}": {
            "get": {"summary": "a file's description", **security, "parameters": file_id,
                    "responses": answer("the file", "File", 404)},
            "delete": {"summary": "delete a file", **security, "parameters": file_id,
                       "responses": answer("deleted", "Deleted", 404)}},
        "/v1/files/{file_id}/content": {"get": {
            "summary": "a file's bytes", **security, "parameters": file_id,
            "responses": {"200": {"description": "the bytes",
                                  "content": {"application/octet-stream": {"schema": {"type": "string"}}}},
                          **errors(*auth_errors, 404, 500, 503)}}},
        "/v1/batches": {
            "post": {"summary": "run a file of requests in the engines' batch class", **security,
                     "requestBody": {"required": True, "content": {JSON: {"schema": _ref("BatchRequest")}}},
                     "responses": answer("the batch (status failed, with errors, when its file's lines break the "
                                         "rules)", "Batch", 400, 404, 408, 413)},
            "get": {"summary": "the caller's batches, newest first", **security, "parameters": page,
                    "responses": answer("batches", "BatchList", 400)}},
        "/v1/batches/{batch_id}": {"get": {"summary": "a batch", **security, "parameters": batch_id,
                                           "responses": answer("the batch", "Batch", 404)}},
        "/v1/batches/{batch_id}/cancel": {"post": {
            "summary": "cancel a batch: its lines under way stop, the rest are not run", **security,
            "parameters": batch_id, "responses": {**answer("the batch, cancelling", "Batch", 404),
                                                  **errors(409)}}},
    }


def schemas() -> dict[str, Any]:
    stamp = {"type": ["integer", "null"]}
    return {
        "BatchRequest": {"type": "object", "additionalProperties": False,
                         "required": ["input_file_id", "endpoint", "completion_window"],
                         "properties": {
                             "input_file_id": {"type": "string", "minLength": 1},
                             "endpoint": {"type": "string", "enum": list(batches_api.ENDPOINTS)},
                             "completion_window": {"type": "string", "enum": list(batches_api.WINDOW_S)},
                             "metadata": {"type": ["object", "null"], "maxProperties": 16,
                                          "propertyNames": {"maxLength": 64},
                                          "additionalProperties": {"type": "string", "maxLength": 512}},
                             "output_expires_after": {"description": "accepted and ignored: outputs are kept 30 "
                                                                     "days"}}},
        "File": {"type": "object", "required": ["id", "object", "bytes", "created_at", "filename", "purpose"],
                 "properties": {"id": {"type": "string"}, "object": {"const": "file"}, "bytes": {"type": "integer"},
                                "created_at": {"type": "integer"}, "expires_at": stamp,
                                "filename": {"type": "string"},
                                "purpose": {"type": "string", "enum": [*files_api.PURPOSES, "batch_output"]},
                                "status": {"type": "string"}}},
        "FileList": {"type": "object", "required": ["object", "data"],
                     "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _ref("File")}}},
        "Deleted": {"type": "object", "required": ["id", "object", "deleted"],
                    "properties": {"id": {"type": "string"}, "object": {"type": "string"},
                                   "deleted": {"type": "boolean"}}},
        "Batch": {"type": "object", "required": ["id", "object", "endpoint", "input_file_id", "status",
                                                 "created_at", "request_counts"],
                  "properties": {
                      "id": {"type": "string"}, "object": {"const": "batch"}, "endpoint": {"type": "string"},
                      "input_file_id": {"type": "string"}, "completion_window": {"type": "string"},
                      "status": {"type": "string", "enum": ["validating", "failed", "in_progress", "finalizing",
                                                            "completed", "expired", "cancelling", "cancelled"]},
                      "output_file_id": {"type": ["string", "null"]}, "error_file_id": {"type": ["string", "null"]},
                      "errors": {"type": ["object", "null"]},
                      "request_counts": {"type": "object", "required": ["total", "completed", "failed"],
                                         "properties": {k: {"type": "integer"}
                                                        for k in ("total", "completed", "failed")}},
                      **{f"{k}_at": stamp for k in ("in_progress", "expires", "finalizing", "completed", "failed",
                                                     "expired", "cancelling", "cancelled")},
                      "created_at": {"type": "integer"}, "metadata": {"type": ["object", "null"]}}},
        "BatchList": {"type": "object", "required": ["object", "data", "has_more"],
                      "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _ref("Batch")},
                                     "has_more": {"type": "boolean"}}},
    }
