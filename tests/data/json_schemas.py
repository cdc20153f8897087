"""Twenty JSON schemas of the kinds applications send as `response_format` (nested objects, arrays,
enums, required fields, numbers with bounds), each with a prompt: the structured-output tests and
bench/grammar.py use them."""

from __future__ import annotations

from typing import Any

_NAME = {"type": "string", "minLength": 1, "maxLength": 40}
_SHORT = {"type": "string", "maxLength": 60}

SCHEMAS: list[tuple[str, str, dict[str, Any]]] = [
    ("person", "Describe a fictional person.", {
        "type": "object", "properties": {"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False}),
    ("color", "Pick a color for a kitchen.", {
        "type": "object", "properties": {"color": {"type": "string", "enum": ["red", "green", "blue", "white"]}},
        "required": ["color"], "additionalProperties": False}),
    ("weather", "Report the weather in Paris.", {
        "type": "object", "properties": {
            "city": _NAME, "celsius": {"type": "number", "minimum": -50, "maximum": 60},
            "sky": {"enum": ["clear", "cloudy", "rain", "snow"]}},
        "required": ["city", "celsius", "sky"], "additionalProperties": False}),
    ("tags", "List three tags for a blog post about cooking.", {
        "type": "object", "properties": {"tags": {"type": "array", "items": _NAME, "minItems": 1, "maxItems": 5}},
        "required": ["tags"], "additionalProperties": False}),
    ("address", "Give a postal address.", {
        "type": "object", "properties": {
            "street": _SHORT, "city": _NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            "country": {"enum": ["FR", "DE", "US", "JP"]}},
        "required": ["street", "city", "zip", "country"], "additionalProperties": False}),
    ("order", "Create an order for two items.", {
        "type": "object", "properties": {
            "order_id": {"type": "integer", "minimum": 1, "maximum": 99999},
            "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                "type": "object", "properties": {
                    "sku": _NAME, "quantity": {"type": "integer", "minimum": 1, "maximum": 10}},
                "required": ["sku", "quantity"], "additionalProperties": False}}},
        "required": ["order_id", "items"], "additionalProperties": False}),
    ("boolean", "Is water wet? Answer with a flag and a reason.", {
        "type": "object", "properties": {"answer": {"type": "boolean"}, "reason": _SHORT},
        "required": ["answer", "reason"], "additionalProperties": False}),
    ("rating", "Rate the movie Alien.", {
        "type": "object", "properties": {
            "title": _NAME, "stars": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["title", "stars"], "additionalProperties": False}),
    ("event", "Describe a meeting.", {
        "type": "object", "properties": {
            "title": _NAME, "attendees": {"type": "array", "items": _NAME, "maxItems": 4},
            "priority": {"enum": ["low", "medium", "high"]}, "minutes": {"type": "integer", "minimum": 5,
                                                                        "maximum": 240}},
        "required": ["title", "attendees", "priority", "minutes"], "additionalProperties": False}),
    ("nested", "Describe a company and its CEO.", {
        "type": "object", "properties": {
            "company": {"type": "object", "properties": {
                "name": _NAME, "ceo": {"type": "object", "properties": {"name": _NAME, "since": {
                    "type": "integer", "minimum": 1900, "maximum": 2030}},
                    "required": ["name", "since"], "additionalProperties": False}},
                "required": ["name", "ceo"], "additionalProperties": False}},
        "required": ["company"], "additionalProperties": False}),
    ("numbers", "Give three measurements between 0 and 1.", {
        "type": "object", "properties": {"values": {"type": "array", "minItems": 3, "maxItems": 3,
                                                    "items": {"type": "number", "minimum": 0, "maximum": 1}}},
        "required": ["values"], "additionalProperties": False}),
    ("sentiment", "Classify: 'I love this phone'.", {
        "type": "object", "properties": {
            "label": {"enum": ["positive", "negative", "neutral"]},
            "score": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["label", "score"], "additionalProperties": False}),
    ("recipe", "Write a short recipe.", {
        "type": "object", "properties": {
            "name": _NAME, "ingredients": {"type": "array", "minItems": 1, "maxItems": 4, "items": _NAME},
            "vegetarian": {"type": "boolean"}},
        "required": ["name", "ingredients", "vegetarian"], "additionalProperties": False}),
    ("optional", "Describe a book; the subtitle is optional.", {
        "type": "object", "properties": {"title": _NAME, "subtitle": _SHORT,
                                         "pages": {"type": "integer", "minimum": 1, "maximum": 2000}},
        "required": ["title", "pages"], "additionalProperties": False}),
    ("point", "Give a point on a map.", {
        "type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                         "lon": {"type": "number", "minimum": -180, "maximum": 180}},
        "required": ["lat", "lon"], "additionalProperties": False}),
    ("matrix", "Give a 2x2 matrix of small integers.", {
        "type": "object", "properties": {"rows": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
            "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": -9,
                                                                     "maximum": 9}}}},
        "required": ["rows"], "additionalProperties": False}),
    ("status", "Report a server's status.", {
        "type": "object", "properties": {
            "host": _NAME, "up": {"type": "boolean"}, "load": {"type": "number", "minimum": 0, "maximum": 100},
            "services": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
                "name": _NAME, "state": {"enum": ["running", "stopped"]}},
                "required": ["name", "state"], "additionalProperties": False}}},
        "required": ["host", "up", "load", "services"], "additionalProperties": False}),
    ("translation", "Translate 'hello' to French.", {
        "type": "object", "properties": {"source": _NAME, "target": _NAME,
                                         "language": {"enum": ["fr", "de", "es"]}},
        "required": ["source", "target", "language"], "additionalProperties": False}),
    ("anyof", "Give an identifier: a number or a name.", {
        "type": "object", "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 1000},
                                                          _NAME]}},
        "required": ["id"], "additionalProperties": False}),
    ("invoice", "Write an invoice.", {
        "type": "object", "properties": {
            "customer": {"type": "object", "properties": {"name": _NAME, "vip": {"type": "boolean"}},
                         "required": ["name", "vip"], "additionalProperties": False},
            "lines": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "object", "properties": {
                "item": _NAME, "price": {"type": "number", "minimum": 0, "maximum": 1000}},
                "required": ["item", "price"], "additionalProperties": False}},
            "currency": {"enum": ["EUR", "USD"]}},
        "required": ["customer", "lines", "currency"], "additionalProperties": False}),
]
