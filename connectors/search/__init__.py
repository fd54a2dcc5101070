"""Search indexing from a dcp-gateway topic (docs/search.md): the rollback-aware client feeds a document
store (SQLite, in the consumer's transaction) and an index backend (tantivy on local disk, or an
Elasticsearch/OpenSearch cluster) that follows it through a journal, with consistent queries."""
