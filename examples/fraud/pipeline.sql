-- Fulmen's fraud-detection pipeline (see README.md in this folder).
-- Run it in the shell with \i examples/fraud/pipeline.sql while fraud-generator writes
-- transactions; the sinks keep running until DROP SINK or the end of the session.

-- Card transactions, as the generator writes them: JSON, keyed by card.
CREATE EXTERNAL TABLE transactions (
  card VARCHAR, customer VARCHAR, amount DOUBLE, country VARCHAR, ts TIMESTAMP
) STORED AS KAFKA LOCATION 'transactions' OPTIONS (
  'bootstrap.servers' 'localhost:9092',
  'start' 'earliest',
  'group.id' 'fulmen-fraud',
  'event_time' 'ts',
  'watermark' '5 seconds',
  'idle_timeout' '10 seconds',
  'retention' '2 hours',
  'dead_letter' 'transactions-dead-letters'
);

-- Customer profiles: an ordinary table the stream is joined with.
CREATE EXTERNAL TABLE profiles STORED AS CSV LOCATION 'fraud-profiles.csv'
OPTIONS ('format.has_header' 'true');

-- Where alerts go (and, being a Kafka table too, where they can be queried).
CREATE EXTERNAL TABLE alerts (
  rule VARCHAR, card VARCHAR, window_start TIMESTAMP, window_end TIMESTAMP, detail VARCHAR
) STORED AS KAFKA LOCATION 'alerts' OPTIONS (
  'bootstrap.servers' 'localhost:9092',
  'start' 'earliest'
);

-- (a) Velocity: more than 5 transactions of one card in a 1-minute tumbling window.
CREATE SINK velocity INTO alerts AS
SELECT 'velocity' AS rule, card, window_start, window_end,
       concat(count(*), ' transactions') AS detail
FROM TUMBLE(transactions, ts, INTERVAL '1 minute')
GROUP BY card, window_start, window_end
HAVING count(*) > 5;

-- (b) Spend against profile: spend in a 10-minute window sliding every minute above
--     10 × the customer's average spend.
CREATE SINK spend INTO alerts AS
SELECT 'spend' AS rule, t.card, t.window_start, t.window_end,
       concat('spent ', sum(t.amount), ', average ', max(p.avg_spend)) AS detail
FROM HOP(transactions, ts, INTERVAL '1 minute', INTERVAL '10 minutes') t
JOIN profiles p ON t.customer = p.customer
GROUP BY t.card, t.window_start, t.window_end
HAVING sum(t.amount) > 10 * max(p.avg_spend);

-- (c) More than 2 countries for one card within an hour.
CREATE SINK countries INTO alerts AS
SELECT 'countries' AS rule, card, window_start, window_end,
       concat(count(DISTINCT country), ' countries') AS detail
FROM TUMBLE(transactions, ts, INTERVAL '1 hour')
GROUP BY card, window_start, window_end
HAVING count(DISTINCT country) > 2;
