//! Comparing answers across engines: rows in order, cells as text, numbers within a
//! relative tolerance (engines differ in how they round averages and in float sums).

/// Whether two cells hold the same value.
pub fn cells_equal(a: &str, b: &str) -> bool {
    if a == b {
        return true;
    }
    match (a.parse::<f64>(), b.parse::<f64>()) {
        (Ok(x), Ok(y)) => {
            let scale = x.abs().max(y.abs()).max(1.0);
            (x - y).abs() <= 1e-6 * scale
        }
        _ => false,
    }
}

/// The first difference between two answers, described, or `None` when they agree.
pub fn first_difference(expected: &[Vec<String>], got: &[Vec<String>]) -> Option<String> {
    if expected.len() != got.len() {
        return Some(format!("{} rows instead of {}", got.len(), expected.len()));
    }
    for (i, (e, g)) in expected.iter().zip(got).enumerate() {
        if e.len() != g.len() {
            return Some(format!(
                "row {i}: {} columns instead of {}",
                g.len(),
                e.len()
            ));
        }
        if let Some(c) = e.iter().zip(g).position(|(x, y)| !cells_equal(x, y)) {
            return Some(format!(
                "row {i}, column {c}: {:?} instead of {:?}",
                g[c], e[c]
            ));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(r: &[&[&str]]) -> Vec<Vec<String>> {
        r.iter()
            .map(|row| row.iter().map(|c| c.to_string()).collect())
            .collect()
    }

    #[test]
    fn numbers_compare_within_tolerance_and_text_exactly() {
        assert!(cells_equal("25.5", "25.500000"));
        assert!(cells_equal("38273.129734621", "38273.12973462"));
        assert!(!cells_equal("1.0", "1.1"));
        assert!(!cells_equal("A", "a"));
        assert!(cells_equal("NULL", "NULL"));
        assert!(!cells_equal("NULL", "0"));
    }

    #[test]
    fn differences_are_described() {
        let a = rows(&[&["A", "1"], &["B", "2"]]);
        assert_eq!(first_difference(&a, &a), None);
        let b = rows(&[&["A", "1"], &["B", "3"]]);
        assert_eq!(
            first_difference(&a, &b).unwrap(),
            "row 1, column 1: \"3\" instead of \"2\""
        );
        assert!(
            first_difference(&a, &b[..1])
                .unwrap()
                .contains("1 rows instead of 2")
        );
    }
}
