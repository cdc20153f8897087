"""The Batch and Files APIs: JSONL batch files, their lines run through the surfaces under the batch class."""
