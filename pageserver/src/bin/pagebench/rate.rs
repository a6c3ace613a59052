//! `pagebench get-page --rate`: how long a run lasts and, in the open-loop mode, when each
//! request is due.
//!
//! `--rate R` asks for R GetPage requests per second in total, over all connections of all
//! tenants, for `--duration` seconds; `--rate R1:D1,R2:D2,...` runs those steps in order (`D` is
//! a number of seconds with `s`, `ms` or `m`, e.g. `2000:5s,20000:10s,2000:5s`) and the run
//! lasts their sum, so `--duration` must then be left out. Without `--rate` the run is the closed
//! loop of `--duration` seconds.
//!
//! Send times: the schedule is a rate that is constant within a step; the requests due by time
//! `t` are its integral `Φ(t)`. Request number `m` (counting over all connections from 0) is due
//! at the `t` where `Φ(t) = m`, and connection `i` of `N` sends requests `i`, `i + N`, `i + 2N`,
//! ...: each connection gets its share R/N, spaced N/R apart, the connections are offset 1/R from
//! one another so that they never send in lockstep, and at a step the spacing changes without a
//! gap or a burst.
//!
//! Pure: no clock and no I/O; `get_page` adds the start instant and does the waiting.

use std::time::Duration;

use anyhow::{bail, ensure, Context};

/// The duration of a closed-loop run, and of a constant `--rate` without `--duration`.
pub const DEFAULT_DURATION_S: f64 = 10.0;
/// Bounds of a rate (requests/s in total) and of a run (seconds): beyond them a value is a typo.
pub const MAX_RATE: f64 = 100_000_000.0;
pub const MAX_DURATION_S: f64 = 100_000_000.0;

/// One step of a schedule: `rps` requests per second for `seconds`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Step {
    pub rps: f64,
    pub seconds: f64,
}

/// What `--rate` says.
#[derive(Debug, Clone, PartialEq)]
pub enum RateArg {
    /// `R`: this rate for `--duration`.
    Constant(f64),
    /// `R:D,...`: these steps in order; the run lasts their sum.
    Steps(Vec<Step>),
}

/// How long a run lasts and, with `--rate`, its schedule.
#[derive(Debug)]
pub struct Plan {
    pub duration: Duration,
    /// `None`: the closed loop.
    pub schedule: Option<Schedule>,
}

/// The run's plan from `--rate` and `--duration` (either may be absent); errors say which flag
/// to check.
pub fn plan(rate: Option<&str>, duration: Option<f64>) -> anyhow::Result<Plan> {
    let rate = rate.map(parse).transpose().context("check --rate")?;
    let steps = match (rate, duration) {
        (Some(RateArg::Steps(_)), Some(seconds)) => bail!(
            "check --rate: a schedule of steps sets the duration (the sum of its steps); \
             leave out --duration {seconds}"
        ),
        (Some(RateArg::Steps(steps)), None) => Some(steps),
        (rate, duration) => {
            let seconds = duration.unwrap_or(DEFAULT_DURATION_S);
            ensure!(
                seconds.is_finite() && seconds > 0.0 && seconds <= MAX_DURATION_S,
                "check --duration: {seconds:?} is not a number of seconds above 0 and at most {MAX_DURATION_S:?}"
            );
            match rate {
                Some(RateArg::Constant(rps)) => Some(vec![Step { rps, seconds }]),
                _ => return Ok(Plan { duration: Duration::from_secs_f64(seconds), schedule: None }),
            }
        }
    };
    let schedule = Schedule::new(steps.unwrap_or_default())?;
    Ok(Plan { duration: Duration::from_secs_f64(schedule.seconds()), schedule: Some(schedule) })
}

/// Parses `R` or `R:D,R:D,...`.
pub fn parse(text: &str) -> anyhow::Result<RateArg> {
    let text = text.trim();
    ensure!(
        !text.is_empty(),
        "empty: give R (requests/s in total) or steps R:D,R:D,... (e.g. 2000:5s,20000:10s)"
    );
    if !text.contains([':', ',']) {
        return Ok(RateArg::Constant(parse_rps(text)?));
    }
    let mut steps = Vec::new();
    for (number, part) in text.split(',').enumerate() {
        let part = part.trim();
        let step = || format!("step {} ({part:?})", number + 1);
        let Some((rps, duration)) = part.split_once(':') else {
            bail!("{}: expected R:D (requests/s : duration, e.g. 2000:5s)", step());
        };
        let rps = parse_rps(rps.trim()).with_context(step)?;
        let seconds = parse_seconds(duration.trim()).with_context(step)?;
        steps.push(Step { rps, seconds });
    }
    Ok(RateArg::Steps(steps))
}

fn parse_rps(text: &str) -> anyhow::Result<f64> {
    let rps: f64 = text
        .parse()
        .ok()
        .filter(|r: &f64| r.is_finite())
        .with_context(|| format!("{text:?} is not a number of requests/s"))?;
    ensure!(rps > 0.0, "a rate of {text} requests/s: the rate must be above 0");
    ensure!(rps <= MAX_RATE, "a rate of {text} requests/s is above {MAX_RATE:?}");
    Ok(rps)
}

/// `5s`, `500ms`, `2m`, or a bare number of seconds.
fn parse_seconds(text: &str) -> anyhow::Result<f64> {
    let (number, unit) = if let Some(n) = text.strip_suffix("ms") {
        (n, 0.001)
    } else if let Some(n) = text.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = text.strip_suffix('m') {
        (n, 60.0)
    } else {
        (text, 1.0)
    };
    let seconds = number
        .trim()
        .parse::<f64>()
        .ok()
        .filter(|n| n.is_finite())
        .map(|n| n * unit)
        .with_context(|| format!("{text:?} is not a duration (a number with s, ms or m, e.g. 5s)"))?;
    ensure!(seconds > 0.0, "a duration of {text}: a step must last more than 0 s");
    ensure!(seconds <= MAX_DURATION_S, "a duration of {text} is more than {MAX_DURATION_S:?} s");
    Ok(seconds)
}

/// A validated, non-empty list of steps and the time and request count at which each starts.
#[derive(Debug, Clone)]
pub struct Schedule {
    steps: Vec<Step>,
    /// Per step: (seconds from the run's start, requests due before it).
    starts: Vec<(f64, f64)>,
    /// Seconds and requests of the whole schedule.
    end: (f64, f64),
}

impl Schedule {
    pub fn new(steps: Vec<Step>) -> anyhow::Result<Self> {
        ensure!(!steps.is_empty(), "check --rate: a schedule needs at least one step");
        let (mut at, mut due) = (0.0, 0.0);
        let mut starts = Vec::with_capacity(steps.len());
        for step in &steps {
            ensure!(
                step.rps.is_finite() && step.rps > 0.0 && step.rps <= MAX_RATE,
                "check --rate: a rate of {:?} requests/s is not above 0 and at most {MAX_RATE:?}",
                step.rps
            );
            ensure!(
                step.seconds.is_finite() && step.seconds > 0.0,
                "check --rate: a step of {:?} s does not last more than 0 s",
                step.seconds
            );
            starts.push((at, due));
            at += step.seconds;
            due += step.rps * step.seconds;
        }
        ensure!(
            at <= MAX_DURATION_S,
            "check --rate: the schedule lasts {at:?} s, more than {MAX_DURATION_S:?} s"
        );
        Ok(Schedule { steps, starts, end: (at, due) })
    }

    /// Seconds from the start to the end of the last step.
    pub fn seconds(&self) -> f64 {
        self.end.0
    }

    /// When request `m` (counted over all connections from 0) is due, from the run's start;
    /// `None` once the schedule is over.
    pub fn send_time(&self, m: u64) -> Option<Duration> {
        let m = m as f64;
        if m >= self.end.1 {
            return None;
        }
        // The last step that starts at or before request m.
        let index = self.starts.partition_point(|&(_, due)| due <= m).checked_sub(1)?;
        let (at, due) = self.starts[index];
        let seconds = (at + (m - due) / self.steps[index].rps).min(self.end.0);
        Duration::try_from_secs_f64(seconds).ok()
    }

    /// The target rate at `seconds` from the start (0 after the end).
    pub fn rate_at(&self, seconds: f64) -> f64 {
        match self.starts.partition_point(|&(at, _)| at <= seconds).checked_sub(1) {
            Some(index) if seconds < self.end.0 => self.steps[index].rps,
            _ => 0.0,
        }
    }

    /// `500/s for 2 s, then 2000/s for 2 s`.
    pub fn describe(&self) -> String {
        let steps: Vec<String> =
            self.steps.iter().map(|s| format!("{}/s for {} s", s.rps, s.seconds)).collect();
        steps.join(", then ")
    }

    /// `[{"rps": .., "duration_s": ..}, ...]` for the summary.
    pub fn json(&self) -> serde_json::Value {
        self.steps.iter().map(|s| serde_json::json!({ "rps": s.rps, "duration_s": s.seconds })).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn steps(text: &str) -> Vec<Step> {
        match parse(text).unwrap() {
            RateArg::Steps(steps) => steps,
            other => panic!("{text}: {other:?}"),
        }
    }

    fn error(rate: Option<&str>, duration: Option<f64>) -> String {
        format!("{:#}", plan(rate, duration).unwrap_err())
    }

    #[test]
    fn parse_accepts_a_rate_and_steps_with_units() {
        assert_eq!(parse("2000").unwrap(), RateArg::Constant(2000.0));
        assert_eq!(parse(" 12.5 ").unwrap(), RateArg::Constant(12.5));
        assert_eq!(
            steps("2000:5s,20000:10s,2000:5s"),
            vec![
                Step { rps: 2000.0, seconds: 5.0 },
                Step { rps: 20000.0, seconds: 10.0 },
                Step { rps: 2000.0, seconds: 5.0 }
            ]
        );
        assert_eq!(
            steps("100:500ms, 200:2m,300:1.5"),
            vec![
                Step { rps: 100.0, seconds: 0.5 },
                Step { rps: 200.0, seconds: 120.0 },
                Step { rps: 300.0, seconds: 1.5 }
            ]
        );
        assert_eq!(steps("7:1s"), vec![Step { rps: 7.0, seconds: 1.0 }]);
    }

    #[test]
    fn parse_refuses_bad_rates_durations_and_shapes_with_the_step_named() {
        for (text, expected) in [
            ("", "empty"),
            ("0", "must be above 0"),
            ("-5", "must be above 0"),
            ("abc", "not a number of requests/s"),
            ("inf", "not a number of requests/s"),
            ("NaN", "not a number of requests/s"),
            ("1e12", "is above"),
            ("2000:0s", "step 1 (\"2000:0s\"): a duration of 0s"),
            ("2000:5s,0:5s", "step 2 (\"0:5s\"): a rate of 0"),
            ("2000:5s,3000", "step 2 (\"3000\"): expected R:D"),
            ("2000:5s,", "step 2 (\"\"): expected R:D"),
            ("2000:5x", "not a duration"),
            ("2000:", "not a duration"),
            ("2000::5s", "not a duration"),
            ("2000:-1s", "must last more than 0"),
            (":5s", "not a number of requests/s"),
        ] {
            let message = format!("{:#}", parse(text).unwrap_err());
            assert!(message.contains(expected), "{text:?}: {message}");
        }
    }

    #[test]
    fn plan_takes_the_duration_from_the_flag_or_the_schedule_and_refuses_both() {
        let closed = plan(None, None).unwrap();
        assert!(closed.schedule.is_none());
        assert_eq!(closed.duration, Duration::from_secs(10));
        assert_eq!(plan(None, Some(2.5)).unwrap().duration, Duration::from_millis(2500));

        let constant = plan(Some("500"), Some(3.0)).unwrap();
        assert_eq!(constant.duration, Duration::from_secs(3));
        assert_eq!(constant.schedule.unwrap().rate_at(1.0), 500.0);
        assert_eq!(plan(Some("500"), None).unwrap().duration, Duration::from_secs(10));

        let stepped = plan(Some("500:2s,2000:2s"), None).unwrap();
        assert_eq!(stepped.duration, Duration::from_secs(4));

        assert!(error(Some("500:2s"), Some(4.0)).contains("leave out --duration"));
        assert!(error(Some("0"), None).starts_with("check --rate: "));
        assert!(error(Some("500:0s"), None).starts_with("check --rate: "));
        for seconds in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e300] {
            assert!(error(None, Some(seconds)).starts_with("check --duration"), "{seconds}");
            assert!(error(Some("5"), Some(seconds)).starts_with("check --duration"), "{seconds}");
        }
        assert!(error(Some("5:1e300s"), None).contains("more than"));
    }

    #[test]
    fn send_times_are_evenly_spaced_within_a_step_and_continue_across_steps() {
        let schedule =
            Schedule::new(vec![Step { rps: 500.0, seconds: 2.0 }, Step { rps: 2000.0, seconds: 2.0 }])
                .unwrap();
        let at = |m| schedule.send_time(m).map(|d| d.as_secs_f64());
        let close = |a: Option<f64>, b: f64| a.is_some_and(|a| (a - b).abs() < 1e-9);
        assert!(close(at(0), 0.0));
        assert!(close(at(1), 0.002));
        assert!(close(at(999), 1.998));
        // request 1000 opens the second step: no gap, no burst
        assert!(close(at(1000), 2.0));
        assert!(close(at(1001), 2.0005));
        assert!(close(at(4999), 3.9995));
        assert_eq!(at(5000), None);
        assert_eq!(at(u64::MAX), None);
        assert_eq!(
            (schedule.rate_at(0.5), schedule.rate_at(2.5), schedule.rate_at(4.0)),
            (500.0, 2000.0, 0.0)
        );
    }

    #[test]
    fn connections_take_every_nth_request_so_each_gets_its_share_offset_from_the_others() {
        // 4 connections at 400/s in total: each sends every 10 ms, connection i from i * 2.5 ms.
        let schedule = Schedule::new(vec![Step { rps: 400.0, seconds: 1.0 }]).unwrap();
        let connections = 4u64;
        for i in 0..connections {
            let times: Vec<f64> = (i..)
                .step_by(connections as usize)
                .map_while(|m| schedule.send_time(m))
                .map(|d| d.as_secs_f64())
                .collect();
            assert_eq!(times.len(), 100, "connection {i}");
            assert!((times[0] - i as f64 * 0.0025).abs() < 1e-9, "connection {i}: {}", times[0]);
            for pair in times.windows(2) {
                assert!((pair[1] - pair[0] - 0.01).abs() < 1e-9, "connection {i}: {pair:?}");
            }
        }
    }

    #[test]
    fn a_rate_below_one_request_per_step_still_ends() {
        let schedule = Schedule::new(vec![Step { rps: 0.5, seconds: 1.0 }]).unwrap();
        assert_eq!(schedule.send_time(0), Some(Duration::ZERO));
        assert_eq!(schedule.send_time(1), None);
    }
}
