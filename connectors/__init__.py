"""Client-side connectors for dcp-gateway's Kafka topics.

Will hold the rollback-aware Kafka client library (a consumer that honours the gateway's rollback
events) and the PySpark data source (``pip install 'dcp-gateway[spark]'``).
"""
