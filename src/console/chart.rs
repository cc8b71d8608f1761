//! The console's small charts: inline SVG drawn from [`super::history`]'s points, 15 minutes
//! wide, newest on the right. Only shapes: the labels (scale, caption) are HTML beside the
//! chart, so they stay readable when the SVG stretches to the card's width. Pure.

use std::fmt::Write as _;
use std::time::Duration;

use super::history::{SAMPLE_EVERY, WINDOW};
use super::render::escape;

/// The drawing's width: one unit per second of the window.
const WIDTH: f64 = WINDOW.as_secs() as f64;
/// The drawing's height (the CSS sets the shown height).
const HEIGHT: f64 = 60.0;
/// Room kept above the highest value.
const HEADROOM: f64 = 4.0;

/// A chart ready to be shown.
#[derive(Debug, Clone, PartialEq)]
pub struct Chart {
    /// The `<svg>` element.
    pub svg: String,
    /// The top of the scale, formatted (e.g. `"200/s"`).
    pub scale: String,
    /// One line that says what the chart shows now (e.g. `"now 12/s · peak 180/s"`).
    pub caption: String,
}

/// The smallest of 1, 2, 5 × 10ⁿ at or above `v` (at least `floor`): a scale that reads well.
fn nice_ceiling(v: f64, floor: f64) -> f64 {
    let v = v.max(floor);
    let exp = v.log10().floor();
    let base = 10f64.powf(exp);
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * base)
        .find(|c| *c >= v - 1e-9)
        .unwrap_or(10.0 * base)
}

/// The x coordinate of a moment `ago` before now.
fn x(ago: Duration) -> f64 {
    (WIDTH - ago.as_secs_f64()).max(0.0)
}

/// The y coordinate of `v` on a scale of `max`.
fn y(v: f64, max: f64) -> f64 {
    HEIGHT - (v / max).clamp(0.0, 1.0) * (HEIGHT - HEADROOM)
}

/// The frame every chart shares: the 5- and 10-minute marks and the baseline.
fn frame(label: &str, body: &str) -> String {
    let mut svg = format!(
        "<svg class=\"chart\" viewBox=\"0 0 {WIDTH} {HEIGHT}\" preserveAspectRatio=\"none\" role=\"img\" aria-label=\"{label}\"><title>{label}</title>",
        label = escape(label)
    );
    for minutes in [5u64, 10] {
        let gx = x(Duration::from_secs(minutes * 60));
        let _ = write!(
            svg,
            "<line class=\"grid\" x1=\"{gx}\" y1=\"0\" x2=\"{gx}\" y2=\"{HEIGHT}\" vector-effect=\"non-scaling-stroke\"/>"
        );
    }
    let _ = write!(
        svg,
        "<line class=\"grid\" x1=\"0\" y1=\"{HEADROOM}\" x2=\"{WIDTH}\" y2=\"{HEADROOM}\" vector-effect=\"non-scaling-stroke\"/>\
         {body}<line class=\"axis\" x1=\"0\" y1=\"{HEIGHT}\" x2=\"{WIDTH}\" y2=\"{HEIGHT}\" vector-effect=\"non-scaling-stroke\"/></svg>"
    );
    svg
}

/// A line with the area under it, of `(ago, value)` points oldest first (`None`: no value,
/// the line breaks there). `format` writes a value with its unit; `floor` is the smallest
/// scale.
pub fn line(
    title: &str,
    points: &[(Duration, Option<f64>)],
    floor: f64,
    format: fn(f64) -> String,
) -> Chart {
    let values: Vec<f64> = points.iter().filter_map(|(_, v)| *v).collect();
    let peak = values.iter().copied().fold(0.0, f64::max);
    let max = nice_ceiling(peak, floor);
    let mut body = String::new();
    // One path per run of points with values.
    for run in points.split(|(_, v)| v.is_none()).filter(|r| !r.is_empty()) {
        let coords: Vec<(f64, f64)> = run
            .iter()
            .filter_map(|(ago, v)| v.map(|v| (x(*ago), y(v, max))))
            .collect();
        let pts = coords
            .iter()
            .map(|(px, py)| format!("{px:.1},{py:.1}"))
            .collect::<Vec<_>>()
            .join(" ");
        if let (Some(first), Some(last)) = (coords.first(), coords.last()) {
            let _ = write!(
                body,
                "<polygon class=\"area\" points=\"{:.1},{HEIGHT} {pts} {:.1},{HEIGHT}\"/>\
                 <polyline class=\"line\" points=\"{pts}\" vector-effect=\"non-scaling-stroke\"/>",
                first.0, last.0
            );
        }
    }
    let caption = match values.last() {
        None => "collecting (a point every 10 s)".to_owned(),
        Some(now) => format!("now {} · peak {}", format(*now), format(peak)),
    };
    let label = format!("{title} over the last 15 minutes: {caption}");
    Chart {
        svg: frame(&label, &body),
        scale: format(max),
        caption,
    }
}

/// Stacked bars, one per sampling interval ending `ago`: `(ago, lower, upper)` counts, drawn
/// in the classes `lower_class` and `upper_class`. `caption` says what the bars total.
pub fn bars(
    title: &str,
    points: &[(Duration, u64, u64)],
    classes: (&str, &str),
    caption: String,
) -> Chart {
    let peak = points.iter().map(|(_, a, b)| a + b).max().unwrap_or(0);
    let max = nice_ceiling(peak as f64, 1.0);
    let width = SAMPLE_EVERY.as_secs_f64() * 0.8;
    let mut body = String::new();
    for (ago, lower, upper) in points {
        let right = x(*ago);
        let left = (right - width).max(0.0);
        let mut base = HEIGHT;
        for (n, class) in [(*lower, classes.0), (*upper, classes.1)] {
            if n == 0 {
                continue;
            }
            let top = y((HEIGHT - base) / (HEIGHT - HEADROOM) * max + n as f64, max);
            let _ = write!(
                body,
                "<rect class=\"{class}\" x=\"{left:.1}\" y=\"{top:.1}\" width=\"{:.1}\" height=\"{:.1}\"/>",
                right - left,
                base - top
            );
            base = top;
        }
    }
    let label = format!("{title} over the last 15 minutes: {caption}");
    Chart {
        svg: frame(&label, &body),
        scale: format!("{max}"),
        caption,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn per_second(v: f64) -> String {
        format!("{v}/s")
    }

    #[test]
    fn scales_are_round_numbers() {
        assert_eq!(nice_ceiling(0.0, 1.0), 1.0);
        assert_eq!(nice_ceiling(3.2, 1.0), 5.0);
        assert_eq!(nice_ceiling(120.0, 1.0), 200.0);
        assert_eq!(nice_ceiling(1000.0, 1.0), 1000.0);
        assert_eq!(nice_ceiling(0.3, 10.0), 10.0);
    }

    #[test]
    fn a_line_puts_now_on_the_right_edge_and_the_peak_under_the_scale() {
        let points = [
            (Duration::from_secs(20), Some(50.0)),
            (Duration::from_secs(10), Some(100.0)),
            (Duration::ZERO, Some(25.0)),
        ];
        let c = line("Throughput", &points, 1.0, per_second);
        assert_eq!(c.scale, "100/s");
        assert_eq!(c.caption, "now 25/s · peak 100/s");
        assert!(
            c.svg.contains("880.0,32.0 890.0,4.0 900.0,46.0"),
            "{}",
            c.svg
        );
        assert!(c.svg.starts_with("<svg") && c.svg.ends_with("</svg>"));
        assert!(
            c.svg
                .contains("aria-label=\"Throughput over the last 15 minutes: now 25/s")
        );
    }

    #[test]
    fn a_line_breaks_where_values_are_missing_and_says_when_it_has_none() {
        let points = [
            (Duration::from_secs(30), Some(1.0)),
            (Duration::from_secs(20), None),
            (Duration::from_secs(10), Some(2.0)),
        ];
        let c = line("Lag", &points, 10.0, per_second);
        assert_eq!(c.svg.matches("<polyline").count(), 2);
        let empty = line("Lag", &[], 10.0, per_second);
        assert_eq!(empty.caption, "collecting (a point every 10 s)");
        assert!(!empty.svg.contains("<polyline"));
    }

    #[test]
    fn bars_stack_their_two_counts() {
        let c = bars(
            "Failures",
            &[(Duration::ZERO, 3, 2), (Duration::from_secs(10), 0, 0)],
            ("msg", "conn"),
            "5 in 15 min".into(),
        );
        assert_eq!(c.scale, "5");
        // 3 of 5 from the baseline (60) towards the top (4), then 2 more to the top.
        assert!(
            c.svg
                .contains("class=\"msg\" x=\"892.0\" y=\"26.4\" width=\"8.0\" height=\"33.6\""),
            "{}",
            c.svg
        );
        assert!(
            c.svg
                .contains("class=\"conn\" x=\"892.0\" y=\"4.0\" width=\"8.0\" height=\"22.4\""),
            "{}",
            c.svg
        );
        assert_eq!(c.svg.matches("<rect").count(), 2);
    }

    #[test]
    fn titles_are_escaped() {
        let c = line("<b>&", &[], 1.0, per_second);
        assert!(c.svg.contains("&lt;b&gt;&amp;") && !c.svg.contains("<b>"));
    }
}
