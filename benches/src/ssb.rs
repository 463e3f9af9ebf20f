//! The Star Schema Benchmark (O'Neil et al.): a lineorder fact table and four dimensions,
//! derived here from the TPC-H tables (so both benchmarks share one generator), and its 13
//! queries, 1.1 to 4.3. Query 3.x orders add the group keys as a final tie-break so that
//! answers compare row by row across engines.

/// The tables, in the order they are written.
pub const TABLES: [&str; 5] = ["lineorder", "date_dim", "customer", "supplier", "part"];

/// How each SSB table is derived from the TPC-H tables (registered under their TPC-H names).
pub const DERIVATIONS: [(&str, &str); 5] = [
    (
        "lineorder",
        "SELECT l_orderkey AS lo_orderkey, l_linenumber AS lo_linenumber, o_custkey AS lo_custkey,
                l_partkey AS lo_partkey, l_suppkey AS lo_suppkey,
                CAST(to_char(o_orderdate, '%Y%m%d') AS INT) AS lo_orderdate,
                o_orderpriority AS lo_orderpriority, o_shippriority AS lo_shippriority,
                CAST(l_quantity AS INT) AS lo_quantity, l_extendedprice AS lo_extendedprice,
                o_totalprice AS lo_ordtotalprice, CAST(l_discount * 100 AS INT) AS lo_discount,
                CAST(l_extendedprice * (1 - l_discount) AS DECIMAL(15, 2)) AS lo_revenue,
                CAST(ps_supplycost * l_quantity AS DECIMAL(15, 2)) AS lo_supplycost,
                CAST(l_tax * 100 AS INT) AS lo_tax,
                CAST(to_char(l_commitdate, '%Y%m%d') AS INT) AS lo_commitdate,
                l_shipmode AS lo_shipmode
         FROM lineitem
         JOIN orders ON l_orderkey = o_orderkey
         JOIN partsupp ON l_partkey = ps_partkey AND l_suppkey = ps_suppkey",
    ),
    (
        "date_dim",
        "SELECT CAST(to_char(d, '%Y%m%d') AS INT) AS d_datekey, d AS d_date,
                CAST(date_part('year', d) AS INT) AS d_year,
                CAST(to_char(d, '%Y%m') AS INT) AS d_yearmonthnum,
                to_char(d, '%b%Y') AS d_yearmonth,
                CAST(date_part('month', d) AS INT) AS d_monthnuminyear,
                CAST(date_part('day', d) AS INT) AS d_daynuminmonth,
                CAST(date_part('week', d) AS INT) AS d_weeknuminyear
         FROM (SELECT CAST(value AS DATE) AS d
               FROM generate_series(TIMESTAMP '1992-01-01', TIMESTAMP '1998-12-31', INTERVAL '1 day'))",
    ),
    (
        "customer",
        "SELECT c_custkey, c_name, c_address,
                concat(rpad(substr(n_name, 1, 9), 9, ' '), CAST(c_custkey % 10 AS VARCHAR)) AS c_city,
                n_name AS c_nation, r_name AS c_region, c_phone, c_mktsegment
         FROM customer JOIN nation ON c_nationkey = n_nationkey JOIN region ON n_regionkey = r_regionkey",
    ),
    (
        "supplier",
        "SELECT s_suppkey, s_name, s_address,
                concat(rpad(substr(n_name, 1, 9), 9, ' '), CAST(s_suppkey % 10 AS VARCHAR)) AS s_city,
                n_name AS s_nation, r_name AS s_region, s_phone
         FROM supplier JOIN nation ON s_nationkey = n_nationkey JOIN region ON n_regionkey = r_regionkey",
    ),
    (
        "part",
        "SELECT p_partkey, p_name,
                concat('MFGR#', substr(p_mfgr, 14, 1)) AS p_mfgr,
                concat('MFGR#', substr(p_brand, 7, 2)) AS p_category,
                concat('MFGR#', substr(p_brand, 7, 2), CAST(p_partkey % 40 + 1 AS VARCHAR)) AS p_brand1,
                p_type, p_size, p_container
         FROM part",
    ),
];

/// The 13 queries, by their SSB numbers.
pub const QUERIES: [(&str, &str); 13] = [
    ("Q1.1", "select sum(lo_extendedprice * lo_discount) as revenue from lineorder, date_dim
        where lo_orderdate = d_datekey and d_year = 1993 and lo_discount between 1 and 3 and lo_quantity < 25"),
    ("Q1.2", "select sum(lo_extendedprice * lo_discount) as revenue from lineorder, date_dim
        where lo_orderdate = d_datekey and d_yearmonthnum = 199401 and lo_discount between 4 and 6
        and lo_quantity between 26 and 35"),
    ("Q1.3", "select sum(lo_extendedprice * lo_discount) as revenue from lineorder, date_dim
        where lo_orderdate = d_datekey and d_weeknuminyear = 6 and d_year = 1994
        and lo_discount between 5 and 7 and lo_quantity between 26 and 35"),
    ("Q2.1", "select sum(lo_revenue) as revenue, d_year, p_brand1 from lineorder, date_dim, part, supplier
        where lo_orderdate = d_datekey and lo_partkey = p_partkey and lo_suppkey = s_suppkey
        and p_category = 'MFGR#12' and s_region = 'AMERICA'
        group by d_year, p_brand1 order by d_year, p_brand1"),
    ("Q2.2", "select sum(lo_revenue) as revenue, d_year, p_brand1 from lineorder, date_dim, part, supplier
        where lo_orderdate = d_datekey and lo_partkey = p_partkey and lo_suppkey = s_suppkey
        and p_brand1 between 'MFGR#2221' and 'MFGR#2228' and s_region = 'ASIA'
        group by d_year, p_brand1 order by d_year, p_brand1"),
    ("Q2.3", "select sum(lo_revenue) as revenue, d_year, p_brand1 from lineorder, date_dim, part, supplier
        where lo_orderdate = d_datekey and lo_partkey = p_partkey and lo_suppkey = s_suppkey
        and p_brand1 = 'MFGR#2239' and s_region = 'EUROPE'
        group by d_year, p_brand1 order by d_year, p_brand1"),
    ("Q3.1", "select c_nation, s_nation, d_year, sum(lo_revenue) as revenue
        from customer, lineorder, supplier, date_dim
        where lo_custkey = c_custkey and lo_suppkey = s_suppkey and lo_orderdate = d_datekey
        and c_region = 'ASIA' and s_region = 'ASIA' and d_year >= 1992 and d_year <= 1997
        group by c_nation, s_nation, d_year order by d_year asc, revenue desc, c_nation, s_nation"),
    ("Q3.2", "select c_city, s_city, d_year, sum(lo_revenue) as revenue
        from customer, lineorder, supplier, date_dim
        where lo_custkey = c_custkey and lo_suppkey = s_suppkey and lo_orderdate = d_datekey
        and c_nation = 'UNITED STATES' and s_nation = 'UNITED STATES' and d_year >= 1992 and d_year <= 1997
        group by c_city, s_city, d_year order by d_year asc, revenue desc, c_city, s_city"),
    ("Q3.3", "select c_city, s_city, d_year, sum(lo_revenue) as revenue
        from customer, lineorder, supplier, date_dim
        where lo_custkey = c_custkey and lo_suppkey = s_suppkey and lo_orderdate = d_datekey
        and (c_city = 'UNITED KI1' or c_city = 'UNITED KI5') and (s_city = 'UNITED KI1' or s_city = 'UNITED KI5')
        and d_year >= 1992 and d_year <= 1997
        group by c_city, s_city, d_year order by d_year asc, revenue desc, c_city, s_city"),
    ("Q3.4", "select c_city, s_city, d_year, sum(lo_revenue) as revenue
        from customer, lineorder, supplier, date_dim
        where lo_custkey = c_custkey and lo_suppkey = s_suppkey and lo_orderdate = d_datekey
        and (c_city = 'UNITED KI1' or c_city = 'UNITED KI5') and (s_city = 'UNITED KI1' or s_city = 'UNITED KI5')
        and d_yearmonth = 'Dec1997'
        group by c_city, s_city, d_year order by d_year asc, revenue desc, c_city, s_city"),
    ("Q4.1", "select d_year, c_nation, sum(lo_revenue - lo_supplycost) as profit
        from date_dim, customer, supplier, part, lineorder
        where lo_custkey = c_custkey and lo_suppkey = s_suppkey and lo_partkey = p_partkey
        and lo_orderdate = d_datekey and c_region = 'AMERICA' and s_region = 'AMERICA'
        and (p_mfgr = 'MFGR#1' or p_mfgr = 'MFGR#2')
        group by d_year, c_nation order by d_year, c_nation"),
    ("Q4.2", "select d_year, s_nation, p_category, sum(lo_revenue - lo_supplycost) as profit
        from date_dim, customer, supplier, part, lineorder
        where lo_custkey = c_custkey and lo_suppkey = s_suppkey and lo_partkey = p_partkey
        and lo_orderdate = d_datekey and c_region = 'AMERICA' and s_region = 'AMERICA'
        and (d_year = 1997 or d_year = 1998) and (p_mfgr = 'MFGR#1' or p_mfgr = 'MFGR#2')
        group by d_year, s_nation, p_category order by d_year, s_nation, p_category"),
    ("Q4.3", "select d_year, s_city, p_brand1, sum(lo_revenue - lo_supplycost) as profit
        from date_dim, customer, supplier, part, lineorder
        where lo_custkey = c_custkey and lo_suppkey = s_suppkey and lo_partkey = p_partkey
        and lo_orderdate = d_datekey and s_nation = 'UNITED STATES'
        and (d_year = 1997 or d_year = 1998) and p_category = 'MFGR#14'
        group by d_year, s_city, p_brand1 order by d_year, s_city, p_brand1"),
];
