//! The run drawn (`<report>.svg` beside the JSON report): three stacked panels on one time
//! axis, committed records/s and in-flight messages with one line per worker slot (a line breaks
//! where its worker stopped; a restarted worker continues it), and the faults, one lane per
//! worker plus the database and the Pub/Sub streams, each fault a labelled vertical marker that
//! runs through the panels above too. The picture to attach to a bug report.
//!
//! SVG through `plotters` without a font dependency: text is laid out on estimated widths and
//! rendered by the viewer.

use crate::timeline::{EventKind, Timeline, WorkerSample};
use plotters::coord::Shift;
use plotters::prelude::*;
use std::collections::BTreeMap;
use std::path::Path;

/// Window of the records/s line: the counter's increase over the last this many seconds
/// (commits come a batch at a time, so a shorter window is all spikes).
const RATE_WINDOW_S: f64 = 2.0;

/// One colour per worker slot (Tableau 10), then round again.
const WORKER_COLOURS: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
    RGBColor(214, 39, 40),
];
const SIGTERM_COLOUR: RGBColor = RGBColor(230, 120, 0);
const SIGKILL_COLOUR: RGBColor = RGBColor(200, 0, 0);
const DATABASE_COLOUR: RGBColor = RGBColor(120, 0, 160);
const STREAMS_COLOUR: RGBColor = RGBColor(0, 110, 150);
const FONT: &str = "sans-serif";

fn worker_colour(slot: usize) -> RGBColor {
    WORKER_COLOURS[slot % WORKER_COLOURS.len()]
}

/// A line of one worker incarnation: (seconds, value) points.
type Line = Vec<(f64, f64)>;

/// Records/s of each incarnation, from its committed counter over [`RATE_WINDOW_S`], plus the
/// sum over all workers at each scrape round.
fn rates(samples: &[WorkerSample]) -> (BTreeMap<(usize, String), Line>, Line) {
    let mut by_incarnation: BTreeMap<(usize, String), Vec<&WorkerSample>> = BTreeMap::new();
    for s in samples.iter().filter(|s| s.committed.is_finite()) {
        by_incarnation
            .entry((s.worker, s.incarnation.clone()))
            .or_default()
            .push(s);
    }
    let mut lines = BTreeMap::new();
    for (key, ss) in by_incarnation {
        let mut line = Vec::new();
        let mut j = 0;
        for i in 1..ss.len() {
            while ss[i].seconds - ss[j].seconds > RATE_WINDOW_S && j + 1 < i {
                j += 1;
            }
            let dt = ss[i].seconds - ss[j].seconds;
            if dt > 0.0 {
                let rate = (ss[i].committed - ss[j].committed).max(0.0) / dt;
                line.push((ss[i].seconds, rate));
            }
        }
        lines.insert(key, line);
    }
    (lines.clone(), total(&lines))
}

/// The sum of every worker's line, on a 0.5 s grid: each line's point nearest to the grid
/// time, within a quarter second (a worker not scraped then counts nothing).
fn total(lines: &BTreeMap<(usize, String), Line>) -> Line {
    let end = lines
        .values()
        .filter_map(|l| l.last().map(|p| p.0))
        .fold(0.0, f64::max);
    let step = 0.5;
    let mut out = Vec::new();
    let mut t = 0.0;
    while t <= end + step {
        let sum: f64 = lines
            .values()
            .filter_map(|l| {
                l.iter()
                    .filter(|p| (p.0 - t).abs() <= step / 2.0)
                    .min_by(|a, b| (a.0 - t).abs().total_cmp(&(b.0 - t).abs()))
                    .map(|p| p.1)
            })
            .sum();
        out.push((t, sum));
        t += step;
    }
    out
}

/// In-flight messages of each incarnation.
fn in_flight(samples: &[WorkerSample]) -> BTreeMap<(usize, String), Line> {
    let mut lines: BTreeMap<(usize, String), Line> = BTreeMap::new();
    for s in samples.iter().filter(|s| s.in_flight.is_finite()) {
        lines
            .entry((s.worker, s.incarnation.clone()))
            .or_default()
            .push((s.seconds, s.in_flight));
    }
    lines
}

/// Draws `timeline` to `path` as SVG; `title` heads it.
pub fn write(timeline: &Timeline, title: &str, path: &Path) -> Result<(), String> {
    let root = SVGBackend::new(path, (1200, 860)).into_drawing_area();
    draw(timeline, title, &root).map_err(|e| format!("{}: {e}", path.display()))?;
    root.present()
        .map_err(|e| format!("{}: {e}", path.display()))
}

type DrawResult = Result<(), DrawingAreaErrorKind<std::io::Error>>;

fn draw(timeline: &Timeline, title: &str, root: &DrawingArea<SVGBackend, Shift>) -> DrawResult {
    root.fill(&WHITE)?;
    let head_px = 14 + 20 * title.lines().count().max(1) as i32;
    let (head, body) = root.split_vertically(head_px);
    for (i, line) in title.lines().enumerate() {
        let (size, colour) = if i == 0 {
            (16, BLACK)
        } else {
            (12, SIGKILL_COLOUR)
        };
        head.draw(&Text::new(
            line.to_string(),
            (12, 10 + 20 * i as i32),
            (FONT, size).into_font().color(&colour),
        ))?;
    }
    let workers = timeline.workers.max(1);
    let lanes = workers + 2;
    let lane_px = 22;
    let faults_px = (lanes as i32 * lane_px + 70).min(360);
    let rest = 860 - head_px - faults_px;
    let panels = body.split_by_breakpoints([] as [i32; 0], [rest * 55 / 100, rest]);
    let (rates_area, flight_area, faults_area) = (&panels[0], &panels[1], &panels[2]);

    let (per_worker, all) = rates(&timeline.samples);
    let flights = in_flight(&timeline.samples);
    let end = timeline
        .samples
        .iter()
        .map(|s| s.seconds)
        .chain(timeline.events.iter().map(|e| e.seconds))
        .fold(1.0, f64::max);
    let x = 0.0..end * 1.01;
    let markers = fault_markers(timeline);

    // Committed records/s.
    let top = all
        .iter()
        .chain(per_worker.values().flatten())
        .map(|p| p.1)
        .fold(1.0, f64::max)
        * 1.1;
    let caption = format!("committed records/s (counter increase over {RATE_WINDOW_S} s)");
    let mut chart = panel(rates_area, &caption, "records/s", x.clone(), top, &markers)?;
    chart
        .draw_series(LineSeries::new(
            all.iter().copied(),
            RGBColor(60, 60, 60).mix(0.55).stroke_width(1),
        ))?
        .label("all workers")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], RGBColor(60, 60, 60)));
    draw_worker_lines(&mut chart, &per_worker)?;
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .label_font((FONT, 11))
        .background_style(WHITE.mix(0.85))
        .border_style(RGBColor(200, 200, 200))
        .draw()?;

    // In-flight messages.
    let top = flights.values().flatten().map(|p| p.1).fold(1.0, f64::max) * 1.1;
    let caption = "in-flight messages (held, not yet settled)";
    let mut chart = panel(flight_area, caption, "messages", x.clone(), top, &markers)?;
    draw_worker_lines(&mut chart, &flights)?;

    // Faults, one lane each.
    let lanes_f = lanes as f64;
    let mut chart = ChartBuilder::on(faults_area)
        .caption(
            "faults (SIGTERM ▼, SIGKILL ✕, database outage, stream drops) and worker lifetimes",
            (FONT, 14),
        )
        .margin_left(10)
        .margin_right(20)
        .margin_bottom(6)
        .x_label_area_size(34)
        .y_label_area_size(56)
        .build_cartesian_2d(x.clone(), 0.0..lanes_f)?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .disable_y_axis()
        .max_light_lines(1)
        .light_line_style(RGBColor(240, 240, 240))
        .x_desc("seconds since the first worker start")
        .label_style((FONT, 11))
        .draw()?;
    let lane_y = |lane: usize| lanes_f - lane as f64 - 0.5;
    let lane_names: Vec<(String, RGBColor)> = (0..workers)
        .map(|w| (format!("worker {w}"), worker_colour(w)))
        .chain([
            ("database".to_string(), DATABASE_COLOUR),
            ("streams".to_string(), STREAMS_COLOUR),
        ])
        .collect();
    // Lane names in the label area, left of the plot.
    for (lane, (name, colour)) in lane_names.iter().enumerate() {
        let (px, py) = chart.backend_coord(&(x.start, lane_y(lane)));
        root.draw(&Text::new(
            name.clone(),
            (px - 54, py - 6),
            (FONT, 11).into_font().color(colour),
        ))?;
    }
    // Worker lifetimes: a bar from each start to the worker's next fault (or the end).
    for (slot, spans) in lifetimes(timeline, end) {
        let y = lane_y(slot);
        chart.draw_series(spans.into_iter().map(|(a, b)| {
            Rectangle::new(
                [(a, y - 0.12), (b, y + 0.12)],
                worker_colour(slot).mix(0.35).filled(),
            )
        }))?;
    }
    for m in &markers {
        let lane = match m.kind {
            EventKind::Sigterm | EventKind::Sigkill => m.worker.unwrap_or(0),
            EventKind::DatabaseOutage | EventKind::DatabaseBack => workers,
            EventKind::StreamsDropped => workers + 1,
            EventKind::Start => continue,
        };
        let y = lane_y(lane);
        if let Some(until) = m.until {
            chart.draw_series(std::iter::once(Rectangle::new(
                [(m.seconds, y - 0.35), (until, y + 0.35)],
                m.colour.mix(0.3).filled(),
            )))?;
        }
        chart.draw_series(std::iter::once(PathElement::new(
            vec![(m.seconds, 0.0), (m.seconds, lanes_f)],
            m.colour.mix(0.5).stroke_width(1),
        )))?;
        chart.draw_series(std::iter::once(Text::new(
            format!("{} {}", m.symbol, m.label),
            (m.seconds, y + 0.3),
            (FONT, 11).into_font().color(&m.colour),
        )))?;
    }
    Ok(())
}

/// A fault to mark: when, which lane, and how it looks.
struct Marker {
    seconds: f64,
    /// The end of a span (a database outage).
    until: Option<f64>,
    kind: EventKind,
    worker: Option<usize>,
    colour: RGBColor,
    symbol: &'static str,
    label: String,
}

fn fault_markers(timeline: &Timeline) -> Vec<Marker> {
    let mut out = Vec::new();
    for (i, e) in timeline.events.iter().enumerate() {
        let (colour, symbol, label) = match e.kind {
            EventKind::Sigterm => (SIGTERM_COLOUR, "▼", "SIGTERM".to_string()),
            EventKind::Sigkill => (SIGKILL_COLOUR, "✕", "SIGKILL".to_string()),
            EventKind::DatabaseOutage => {
                let back = timeline.events[i..]
                    .iter()
                    .find(|b| b.kind == EventKind::DatabaseBack)
                    .map(|b| b.seconds);
                let label = back.map_or("database outage".to_string(), |b| {
                    format!("database outage {:.1} s", b - e.seconds)
                });
                out.push(Marker {
                    seconds: e.seconds,
                    until: back,
                    kind: e.kind,
                    worker: None,
                    colour: DATABASE_COLOUR,
                    symbol: "■",
                    label,
                });
                continue;
            }
            EventKind::StreamsDropped => (STREAMS_COLOUR, "↯", "streams dropped".to_string()),
            EventKind::DatabaseBack | EventKind::Start => continue,
        };
        out.push(Marker {
            seconds: e.seconds,
            until: None,
            kind: e.kind,
            worker: e.worker,
            colour,
            symbol,
            label,
        });
    }
    out
}

/// Each slot's up periods: from a start to the next SIGTERM/SIGKILL of that slot, or `end`.
fn lifetimes(timeline: &Timeline, end: f64) -> BTreeMap<usize, Vec<(f64, f64)>> {
    let mut open: BTreeMap<usize, f64> = BTreeMap::new();
    let mut spans: BTreeMap<usize, Vec<(f64, f64)>> = BTreeMap::new();
    for e in &timeline.events {
        let Some(w) = e.worker else { continue };
        match e.kind {
            EventKind::Start => {
                open.insert(w, e.seconds);
            }
            EventKind::Sigterm | EventKind::Sigkill => {
                if let Some(a) = open.remove(&w) {
                    spans.entry(w).or_default().push((a, e.seconds));
                }
            }
            _ => {}
        }
    }
    for (w, a) in open {
        spans.entry(w).or_default().push((a, end));
    }
    spans
}

/// A panel of the chart: seconds across, a count or rate up.
type Panel<'a, DB> = ChartContext<
    'a,
    DB,
    Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
>;

/// A panel of the chart over `x` and 0..`top`: its caption, axes and light grid, and the fault
/// markers running through it, ready for its lines.
fn panel<'a, DB: DrawingBackend>(
    area: &'a DrawingArea<DB, Shift>,
    caption: &str,
    y_desc: &str,
    x: std::ops::Range<f64>,
    top: f64,
    markers: &[Marker],
) -> Result<Panel<'a, DB>, DrawingAreaErrorKind<DB::ErrorType>> {
    let mut chart = ChartBuilder::on(area)
        .caption(caption, (FONT, 14))
        .margin_left(10)
        .margin_right(20)
        .x_label_area_size(22)
        .y_label_area_size(56)
        .build_cartesian_2d(x, 0.0..top)?;
    chart
        .configure_mesh()
        .max_light_lines(1)
        .light_line_style(RGBColor(240, 240, 240))
        .y_desc(y_desc)
        .label_style((FONT, 11))
        .draw()?;
    draw_markers(&mut chart, markers, top)?;
    Ok(chart)
}

fn draw_markers<DB: DrawingBackend>(
    chart: &mut Panel<'_, DB>,
    markers: &[Marker],
    top: f64,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    for m in markers {
        if let Some(until) = m.until {
            chart.draw_series(std::iter::once(Rectangle::new(
                [(m.seconds, 0.0), (until, top)],
                m.colour.mix(0.08).filled(),
            )))?;
        }
        chart.draw_series(std::iter::once(PathElement::new(
            vec![(m.seconds, 0.0), (m.seconds, top)],
            m.colour.mix(0.45).stroke_width(1),
        )))?;
    }
    Ok(())
}

/// One line per incarnation, coloured by slot; one legend entry per slot.
fn draw_worker_lines<DB: DrawingBackend>(
    chart: &mut Panel<'_, DB>,
    lines: &BTreeMap<(usize, String), Line>,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let mut labelled = std::collections::BTreeSet::new();
    for ((slot, _), line) in lines {
        let colour = worker_colour(*slot);
        let series = chart.draw_series(LineSeries::new(
            line.iter().copied(),
            colour.stroke_width(2),
        ))?;
        if labelled.insert(*slot) {
            series
                .label(format!("worker {slot}"))
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], colour.stroke_width(2))
                });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::timeline::TimelineEvent;

    fn sample(seconds: f64, worker: usize, incarnation: &str, committed: f64) -> WorkerSample {
        WorkerSample {
            seconds,
            worker,
            incarnation: incarnation.into(),
            committed,
            failed: 0.0,
            in_flight: 4.0,
            received: committed,
            nacked: 0.0,
            released: 0.0,
            ready: 1.0,
        }
    }

    #[test]
    fn rates_restart_with_each_incarnation() {
        let samples = vec![
            sample(0.0, 0, "w0-1", 0.0),
            sample(1.0, 0, "w0-1", 10.0),
            sample(2.0, 0, "w0-1", 30.0),
            sample(3.0, 0, "w0-1", 50.0),
            // Restarted: the counter starts from zero again, no negative rate.
            sample(5.0, 0, "w0-2", 0.0),
            sample(6.0, 0, "w0-2", 8.0),
        ];
        let (lines, total) = rates(&samples);
        assert_eq!(
            lines[&(0, "w0-1".into())],
            vec![(1.0, 10.0), (2.0, 15.0), (3.0, 20.0)]
        );
        assert_eq!(lines[&(0, "w0-2".into())], vec![(6.0, 8.0)]);
        assert!(total.iter().all(|p| p.1 >= 0.0));
    }

    #[test]
    fn the_chart_is_an_svg_with_every_worker_and_fault() {
        let mut samples = Vec::new();
        for i in 0..40 {
            let t = i as f64 * 0.5;
            samples.push(sample(t, 0, "w0-1", t * 20.0));
            if t < 8.0 {
                samples.push(sample(t, 1, "w1-1", t * 15.0));
            } else if t > 9.0 {
                samples.push(sample(t, 1, "w1-2", (t - 9.0) * 15.0));
            }
        }
        let ev = |seconds, kind, worker| TimelineEvent {
            seconds,
            kind,
            worker,
        };
        let timeline = Timeline {
            started_unix: 0.0,
            sample_every_seconds: 0.5,
            workers: 2,
            events: vec![
                ev(0.0, EventKind::Start, Some(0)),
                ev(0.0, EventKind::Start, Some(1)),
                ev(8.0, EventKind::Sigterm, Some(1)),
                ev(9.0, EventKind::Start, Some(1)),
                ev(12.0, EventKind::Sigkill, Some(0)),
                ev(13.0, EventKind::DatabaseOutage, None),
                ev(15.0, EventKind::DatabaseBack, None),
                ev(16.0, EventKind::StreamsDropped, None),
            ],
            samples,
        };
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("chart.svg");
        write(&timeline, "test run", &path).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..100]);
        for text in [
            "worker 0",
            "worker 1",
            "SIGTERM",
            "SIGKILL",
            "database outage 2.0 s",
            "streams dropped",
            "committed records/s",
            "in-flight messages",
        ] {
            assert!(svg.contains(text), "{text} missing");
        }
    }
}
