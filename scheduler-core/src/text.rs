//! Text for a terminal, shared by `simulate` and `kubectl tessera`.

/// Left-aligned columns two spaces apart, the last column unpadded, one line per row after the
/// header.
pub fn table<const N: usize>(header: [&str; N], rows: &[[String; N]]) -> String {
    let mut widths = header.map(|h| h.chars().count());
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: [&str; N]| {
        let mut l = String::new();
        for (i, cell) in cells.iter().enumerate() {
            if i + 1 == N {
                l.push_str(cell);
            } else {
                l.push_str(&format!("{cell:<width$}  ", width = widths[i]));
            }
        }
        l.trim_end().to_owned() + "\n"
    };
    let mut out = line(header);
    for row in rows {
        out.push_str(&line(row.each_ref().map(String::as_str)));
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn columns_line_up_and_the_last_is_not_padded() {
        let t = super::table(
            ["A", "LONG HEADER", "LAST"],
            &[
                ["wide cell".into(), "x".into(), "end".into()],
                ["y".into(), "z".into(), String::new()],
            ],
        );
        assert_eq!(
            t,
            "A          LONG HEADER  LAST\nwide cell  x            end\ny          z\n"
        );
    }
}
